"""Typed replies of STACE's agents (pydantic); their JSON schemas drive constrained decoding.

Field lengths are bounded so that a small model under constrained decoding cannot loop
inside one string for its whole token budget.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, Field

Short = Field(max_length=300)


class TaskSpec(BaseModel):
    """Task Verification's output: the free-text request in precise terms."""

    target_concept: str = Field(max_length=80)
    category: Literal["object", "style", "ip", "explicit", "celebrity", "shape", "other"]
    erased_model: str = Field(max_length=120)
    erasure_method: str = Field(max_length=60)
    evaluator: str = Field(max_length=60, description="one of the evaluators offered")
    success_criterion: str = Field(max_length=300)
    missing_information: list[str] = Field(default_factory=list, max_length=5)


class Hypothesis(BaseModel):
    """A stress-testing hypothesis H: a test-time strategy with its arguments."""

    title: str = Field(max_length=120)
    rationale: str = Field(max_length=500)
    strategy: Literal["synonym", "description", "composition", "style_context", "typo",
                      "negative_prompt", "guidance", "embedding", "other"]
    prompts: list[str] = Field(min_length=1, max_length=12,
                               description="example prompts that instantiate the hypothesis")
    evaluation: str = Field(max_length=300, description="how its images are evaluated: the evaluator and "
                                                        "what it must find (the paper's evaluation methods)")
    success_criterion: str = Field(max_length=300)


class Critique(BaseModel):
    """The Critic's verdict on novelty, feasibility and detailedness (scores 1-5)."""

    novelty: int = Field(ge=1, le=5)
    feasibility: int = Field(ge=1, le=5)
    detailedness: int = Field(ge=1, le=5)
    feedback: str = Field(max_length=600)


class Queries(BaseModel):
    """The Query Generator's retrieval queries for the PaperCard library."""

    queries: list[str] = Field(min_length=1, max_length=3)


class ProbeInstance(BaseModel):
    """One instantiation of H: a generation request rendered by the harness."""

    prompt: str = Field(max_length=300)
    negative_prompt: Optional[str] = Field(default=None, max_length=200)
    guidance_scale: Optional[float] = Field(default=None, ge=0.0, le=30.0)
    num_inference_steps: Optional[int] = Field(default=None, ge=1, le=100)
    seed: Optional[int] = Field(default=None, ge=0)


class ProbePlan(BaseModel):
    """The declarative probe-plan mode: k instantiations as data, no code."""

    probes: list[ProbeInstance] = Field(min_length=1, max_length=64)


class CodeReply(BaseModel):
    """The Code Synthesiser's output: a Python program using the probe API."""

    explanation: str = Field(max_length=400)
    code: str = Field(max_length=8000)


class Experience(BaseModel):
    """The Experience Summariser's record of one iteration (fed to the next): target type,
    probing strategy, experiment design, outcome and lesson (§3.3.4); the harness adds the
    hypothesis's novelty score, which it measures itself."""

    target_type: str = Field(max_length=60)
    strategy: str = Field(max_length=300)
    design: str = Field(max_length=300, description="the experiment design: probes, settings, images")
    outcome: str = Field(max_length=300)
    lesson: str = Field(max_length=400)


class Report(BaseModel):
    """The Report Summariser's text."""

    summary: str = Field(max_length=4000)
    vulnerabilities: list[str] = Field(default_factory=list, max_length=10)
    recommendations: list[str] = Field(default_factory=list, max_length=10)


class PaperCard(BaseModel):
    """A structured summary of one paper (STACE §3.2)."""

    key: str = Field(max_length=40)
    title: str = Field(max_length=200)
    year: int = Field(ge=2000, le=2100)
    kind: Literal["erasure", "attack", "benchmark", "safety", "other"]
    task: str = Field(max_length=400)
    model_types: list[str] = Field(max_length=8)
    method: str = Field(max_length=800)
    settings: str = Field(max_length=500)
    limitations: str = Field(max_length=500)
    code: Optional[str] = Field(default=None, max_length=200)

    def text(self) -> str:
        """What is embedded for retrieval and novelty."""
        return (f"{self.title}. Task: {self.task} Method: {self.method} Settings: {self.settings} "
                f"Limitations: {self.limitations}")
