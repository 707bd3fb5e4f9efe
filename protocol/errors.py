"""Error codes and the exceptions of the wire layer.

Exception tree::

    ProtocolError            anything wrong with bytes or messages that crossed a boundary
    ├── FrameError           a frame that is truncated, malformed or carries an unsupported value
    │   └── MessageTooLarge  a message (or the chunked ones in progress) over the receiver's limit
    │       └── ReassemblyFull  refused for now: the chunked messages in progress fill the budget
    ├── Located              inside the codec only: a failure deep in a value, with its path
    ├── BadMessage           an incoming message that is not a frame or not a valid message
    ├── BadCompressedTree    a compressed tree (protocol.compressed_trees) that cannot be decoded
    ├── PiecesMismatch       a sharded run's pieces (protocol.files.shard_pieces) not of one model
    ├── VersionMismatch      the peer speaks another protocol version
    ├── UnexpectedReply      the peer answered with a kind of message this side did not ask for
    ├── ChannelClosed        the connection closed before the reply came
    ├── SessionError         a session event its state does not allow (a bug of this side)
    ├── RemoteError          the peer answered a request with an ``error`` reply (its fault)
    └── RequestRefused       raised by a handler of ours: answer this request with an ``error``
        └── UnexpectedHello  a connection's first message is not the hello this side expects

:class:`RemoteError` is what a requester sees of the peer's refusal; :class:`RequestRefused` is
how a handler refuses (the channel turns it into the ``error`` reply). They carry the same
:class:`ErrorInfo`, but one is the other side's word and the other is ours.

Remote failures travel as data (:class:`ErrorInfo` inside a reply), never as pickled exceptions;
the receiving side turns them back into its own package's exception types.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field


class ErrorCode(StrEnum):
    """What went wrong, as a stable string that travels in ``error.code``."""

    BAD_REQUEST = "bad_request"  # a message that failed validation or named an unknown kind
    BAD_FRAME = "bad_frame"  # bytes that are not a frame of the codec
    FILTER_ERROR = "filter_error"  # user code (fit/forward/loss) raised
    UNKNOWN_NODE = "unknown_node"  # a node id that is not loaded
    NOT_FITTED = "not_fitted"  # forward of a node that has no state yet
    NO_GRADIENTS = "no_gradients"  # a node without parameters, or whose parameters have no grad
    GRADIENT_MISMATCH = "gradient_mismatch"  # names or shapes that are not the same model
    STATE_MISMATCH = "state_mismatch"  # a state that does not fit the node
    DAEMON_CRASHED = "daemon_crashed"  # the filter daemon died while (or before) answering
    TIMEOUT = "timeout"  # no answer within the request's timeout
    VERSION_MISMATCH = "version_mismatch"  # the peer speaks another protocol version
    UNAUTHORIZED = "unauthorized"  # a missing or wrong token
    TOO_LARGE = "too_large"  # a message over the size limit
    BUSY = "busy"  # too many requests in flight on this connection: retry after a reply
    WORKER_LOST = "worker_lost"  # a worker disconnected or stopped heartbeating mid-job
    UNKNOWN_JOB = "unknown_job"  # a job id the coordinator (or agent) does not know
    NO_WORKERS = "no_workers"  # no registered worker can ever match the job's needs
    CANCELLED = "cancelled"  # the job was cancelled
    AGGREGATION_MISMATCH = "aggregation_mismatch"  # contributions that are not the same model
    NOT_ENOUGH_WORKERS = "not_enough_workers"  # a round where fewer than min_workers answered
    NOT_FINISHED = "not_finished"  # a result asked for before the job ended
    NO_CHECKPOINT = "no_checkpoint"  # a checkpoint asked for that the job does not have
    SHUTTING_DOWN = "shutting_down"  # the coordinator is stopping
    COORDINATOR_RESTARTED = "coordinator_restarted"  # the job was running when it restarted
    COLLECTIVE_FAILED = "collective_failed"  # a torch.distributed group broke or timed out
    RESOURCE_LIMIT = "resource_limit"  # a job's daemon went over --max-job-memory/--max-job-procs
    TIME_LIMIT = "time_limit"  # a job ran past the time_limit it was submitted with
    PREEMPTED = "preempted"  # a job's run stopped to make room for another (it is queued again)
    INTERNAL = "internal"  # a bug on the answering side


class ErrorInfo(BaseModel):
    """The payload of an error reply: what happened, in words and in a code."""

    code: ErrorCode
    message: str
    detail: dict[str, Any] = Field(default_factory=dict)


class ProtocolError(Exception):
    """Root of the errors raised by :mod:`protocol`."""


class FrameError(ProtocolError):
    """A frame that cannot be encoded or decoded; the message says what and where."""


class MessageTooLarge(FrameError):
    """A message over the receiver's size limit, refused before its buffer was allocated.

    ``reply_to`` is the message's ``id`` and ``answers`` its ``reply_to``, when they could be
    read from its first bytes: the error reply can then name the request, and a reply that is
    refused can fail the request waiting for it.
    """

    def __init__(self, message: str, reply_to: int | None = None, answers: int | None = None):
        super().__init__(message)
        self.reply_to = reply_to
        self.answers = answers


class ReassemblyFull(MessageTooLarge):
    """A chunked message refused for now, not for its size: the chunked messages in progress
    on all of the receiver's connections fill its reassembly budget (answered ``busy``)."""


class Located(ProtocolError):
    """A failure inside a frame's body, with the path to it collected while unwinding.

    The codec's own: :func:`protocol.codec.encode` and ``decode`` turn it into a
    :class:`FrameError` naming where (``body['x'][2]``); it never leaves them.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.path: list[str] = []

    def where(self) -> str:
        """The path to the failure, from the body down."""
        return "body" + "".join(reversed(self.path))


class BadMessage(ProtocolError):
    """An incoming message that is not a frame or not a valid message."""

    def __init__(self, info: ErrorInfo, reply_to: int | None) -> None:
        super().__init__(info.message)
        self.info = info
        self.reply_to = reply_to


class BadCompressedTree(ProtocolError):
    """A compressed tree (:mod:`protocol.compressed_trees`) that cannot be decoded: why."""


class PiecesMismatch(ProtocolError):
    """A sharded run's replicas' pieces (:mod:`protocol.files.shard_pieces`) that are not of one
    model: their split paths or their rows' shapes differ. Which, and where."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version."""


class UnexpectedReply(ProtocolError):
    """The peer answered with a message of another kind than the one this side waits for
    (``kind`` is the one it sent)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class SessionError(ProtocolError):
    """A session event that its current state does not allow: a bug of this side."""


class ChannelClosed(ProtocolError):
    """The connection closed before the reply came (``reason`` says why, when known)."""


class RemoteError(ProtocolError):
    """The peer answered a request with an ``error`` reply."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info
        self.code = info.code


class RequestRefused(ProtocolError):
    """Raised by a request handler to answer with an ``error`` reply carrying ``info``."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info
        self.code = info.code

    @classmethod
    def of(cls, code: ErrorCode, message: str, **detail: Any) -> RequestRefused:
        """A refusal built from its parts."""
        return cls(ErrorInfo(code=code, message=message, detail=detail))


class UnexpectedHello(RequestRefused):
    """A connection's first message is not the hello this side expects: refused with ``info``
    (``reply_to`` is that message's id)."""

    def __init__(self, info: ErrorInfo, reply_to: int | None) -> None:
        super().__init__(info)
        self.reply_to = reply_to
