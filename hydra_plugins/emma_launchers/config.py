"""Config schema of ``hydra/launcher=local``: submitit_local plus a cap on parallel cells."""
# no `from __future__ import annotations`: Hydra execs plugin modules outside sys.modules,
# where dataclasses cannot resolve string annotations


from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf


@dataclass
class EmmaLocalQueueConf(LocalQueueConf):
    _target_: str = "hydra_plugins.emma_launchers.launchers.EmmaLocalLauncher"
    # submitit's local executor starts every job at once; run at most this many cells at a time
    parallelism: int = 2


ConfigStore.instance().store(group="hydra/launcher", name="emma_submitit_local", node=EmmaLocalQueueConf,
                             provider="emma_launchers")
