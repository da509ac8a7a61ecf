"""Typed messages and their (de)serialisation to frames, by their public names.

Each job lives in its own module; this one gathers their public names so that
``from shared_protocol.messages import ...`` keeps working (new code imports from
the module that does the job):

- :mod:`.message_base`: the :class:`Message` base, field declarations
  (:func:`tensor`, :func:`tensor_dict`, :func:`record`), the registry of message
  types, :func:`encode_message` / :func:`decode_message`;
- :mod:`.core_messages`: the message types every method uses (importing this
  module registers them);
- :mod:`.secagg_messages`: secure aggregation's, which any summing method may use.
"""

from __future__ import annotations

from .core_messages import (
    Discover,
    ErrorReply,
    EvalReport,
    EvalRequest,
    EvalSetData,
    EvalSetRequest,
    Hello,
    PublicEvalSet,
    RoundEnd,
    RoundStart,
    Shutdown,
    Status,
    Welcome,
    check_metric_names,
)
from . import secagg_messages  # noqa: F401  (registers secure aggregation's types, used by any summing method)
from .message_base import (
    Message,
    TensorSpec,
    check_labels,
    check_same_length,
    decode_message,
    encode_message,
    message_types,
    new_message_id,
    peek_header,
    record,
    register_message,
    tensor,
    tensor_dict,
)

__all__ = [
    "TensorSpec",
    "tensor",
    "tensor_dict",
    "record",
    "Message",
    "register_message",
    "message_types",
    "encode_message",
    "decode_message",
    "peek_header",
    "check_same_length",
    "check_labels",
    "check_metric_names",
    "Hello",
    "Welcome",
    "RoundStart",
    "RoundEnd",
    "EvalRequest",
    "EvalReport",
    "EvalSetRequest",
    "EvalSetData",
    "PublicEvalSet",
    "ErrorReply",
    "Status",
    "Shutdown",
    "Discover",
    "new_message_id",
]
