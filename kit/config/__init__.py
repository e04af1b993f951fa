"""The run configuration: frozen dataclasses, one commented line per field, validated on creation.

A ``run.yaml`` has one section per concern; each is a dataclass here, and ``RunConfig`` holds
them all and checks them against each other::

    model:          ModelConfig          kit.config.model     the ALBERT every peer trains
    tokenizer:      TokenizerConfig      kit.config.data      how text becomes token ids
    data:           DataConfig           kit.config.data      the streamed corpus (SourceConfig)
    optimizer:      OptimizerConfig      kit.config.training  LAMB/AdamW and the LR schedule
    collaboration:  CollaborationConfig  kit.config.training  global batch, averaging, codecs
    access:         AccessConfig         kit.config.access    allowlist, authority, coordinator
    checkpoint:     CheckpointConfig     kit.config.access    local folder and Hub pushes

Each section has ``from_dict`` (unknown keys are errors, with a did-you-mean) and ``to_dict``
(plain lists and dicts, ready for ``yaml.safe_dump``/``json.dumps``); bad values raise
:class:`~kit.errors.ConfigError` ending with ``help:``. ``kit.config.fields`` holds the shared
validation helpers and file loading.

It doesn't hold anything that reads the hardware, the network or torch (transformers is imported
only inside ``ModelConfig.to_transformers()``): the coordinator loads this on a small CPU box,
and tests construct configs without side effects. It reads no environment variables.
"""

from kit.config.access import AccessConfig, CheckpointConfig
from kit.config.data import DataConfig, SourceConfig, TokenizerConfig
from kit.config.fields import (
    check_bool,
    check_choice,
    check_hub_name,
    check_int,
    check_number,
    check_probability,
    check_text,
    config_error,
    load_config_file,
    read_section,
)
from kit.config.model import ModelConfig
from kit.config.run import RunConfig
from kit.config.training import COMPRESSIONS, CollaborationConfig, OptimizerConfig

__all__ = [
    "COMPRESSIONS",
    "AccessConfig",
    "CheckpointConfig",
    "CollaborationConfig",
    "DataConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RunConfig",
    "SourceConfig",
    "TokenizerConfig",
    "check_bool",
    "check_choice",
    "check_hub_name",
    "check_int",
    "check_number",
    "check_probability",
    "check_text",
    "config_error",
    "load_config_file",
    "read_section",
]
