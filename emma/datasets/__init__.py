"""External data with pinned downloads: prompt sets, bias sets and the download helper."""

from emma.datasets.bias import BiasPromptSet, bias_prompt_set, profession_bias_prompt_set
from emma.datasets.download import (
    ChecksumError,
    DataUnavailableError,
    RemoteFile,
    cache_dir,
    fetch,
    is_offline,
)
from emma.datasets.external import (
    I2P_CATEGORIES,
    PROMPT_SETS,
    ExternalPrompt,
    PromptSet,
    load_coco30k,
    load_i2p,
    load_prompt_set,
    load_unlearndiffatk,
)

__all__ = [
    "BiasPromptSet",
    "ChecksumError",
    "DataUnavailableError",
    "ExternalPrompt",
    "I2P_CATEGORIES",
    "PROMPT_SETS",
    "PromptSet",
    "RemoteFile",
    "bias_prompt_set",
    "cache_dir",
    "fetch",
    "is_offline",
    "load_coco30k",
    "load_i2p",
    "load_prompt_set",
    "load_unlearndiffatk",
    "profession_bias_prompt_set",
]
