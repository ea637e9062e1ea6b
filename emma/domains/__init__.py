"""Concept domains and their prompt suites (EMMA's published files or our own content)."""

from emma.domains.base import (
    KNOWN_CLASSIFIERS,
    EmmaDomain,
    available_domains,
    build_domain,
    load_domain,
    load_domain_config,
)
from emma.domains.emma_official import (
    EMMA_COMMIT,
    EMMA_REPO,
    Defect,
    EmmaOfficialSuite,
    EmmaPromptFiles,
    read_emma_prompts,
)
from emma.domains.generated import AuthoredContent, GeneratedSuite, load_authored
from emma.domains.text import PREFIX_CATEGORIES
from emma.domains.validate import NameLeak, NameLeakError, check_descriptions, find_name_leaks

__all__ = [
    "AuthoredContent",
    "Defect",
    "EMMA_COMMIT",
    "EMMA_REPO",
    "EmmaDomain",
    "EmmaOfficialSuite",
    "EmmaPromptFiles",
    "GeneratedSuite",
    "KNOWN_CLASSIFIERS",
    "NameLeak",
    "NameLeakError",
    "PREFIX_CATEGORIES",
    "available_domains",
    "build_domain",
    "check_descriptions",
    "find_name_leaks",
    "load_authored",
    "load_domain",
    "load_domain_config",
    "read_emma_prompts",
]
