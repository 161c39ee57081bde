from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PacketType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DIAL_REQ: _ClassVar[PacketType]
    DIAL_RSP: _ClassVar[PacketType]
    CLOSE_REQ: _ClassVar[PacketType]
    CLOSE_RSP: _ClassVar[PacketType]
    DATA: _ClassVar[PacketType]
    DIAL_CLS: _ClassVar[PacketType]
    DRAIN: _ClassVar[PacketType]
DIAL_REQ: PacketType
DIAL_RSP: PacketType
CLOSE_REQ: PacketType
CLOSE_RSP: PacketType
DATA: PacketType
DIAL_CLS: PacketType
DRAIN: PacketType

class Packet(_message.Message):
    __slots__ = ("type", "dialRequest", "dialResponse", "data", "closeRequest", "closeResponse", "closeDial", "drain")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    DIALREQUEST_FIELD_NUMBER: _ClassVar[int]
    DIALRESPONSE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CLOSEREQUEST_FIELD_NUMBER: _ClassVar[int]
    CLOSERESPONSE_FIELD_NUMBER: _ClassVar[int]
    CLOSEDIAL_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    type: PacketType
    dialRequest: DialRequest
    dialResponse: DialResponse
    data: Data
    closeRequest: CloseRequest
    closeResponse: CloseResponse
    closeDial: CloseDial
    drain: Drain
    def __init__(self, type: _Optional[_Union[PacketType, str]] = ..., dialRequest: _Optional[_Union[DialRequest, _Mapping]] = ..., dialResponse: _Optional[_Union[DialResponse, _Mapping]] = ..., data: _Optional[_Union[Data, _Mapping]] = ..., closeRequest: _Optional[_Union[CloseRequest, _Mapping]] = ..., closeResponse: _Optional[_Union[CloseResponse, _Mapping]] = ..., closeDial: _Optional[_Union[CloseDial, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ...) -> None: ...

class DialRequest(_message.Message):
    __slots__ = ("protocol", "address", "random")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RANDOM_FIELD_NUMBER: _ClassVar[int]
    protocol: str
    address: str
    random: int
    def __init__(self, protocol: _Optional[str] = ..., address: _Optional[str] = ..., random: _Optional[int] = ...) -> None: ...

class DialResponse(_message.Message):
    __slots__ = ("error", "connectID", "random")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CONNECTID_FIELD_NUMBER: _ClassVar[int]
    RANDOM_FIELD_NUMBER: _ClassVar[int]
    error: str
    connectID: int
    random: int
    def __init__(self, error: _Optional[str] = ..., connectID: _Optional[int] = ..., random: _Optional[int] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("connectID",)
    CONNECTID_FIELD_NUMBER: _ClassVar[int]
    connectID: int
    def __init__(self, connectID: _Optional[int] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ("error", "connectID")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CONNECTID_FIELD_NUMBER: _ClassVar[int]
    error: str
    connectID: int
    def __init__(self, error: _Optional[str] = ..., connectID: _Optional[int] = ...) -> None: ...

class CloseDial(_message.Message):
    __slots__ = ("random",)
    RANDOM_FIELD_NUMBER: _ClassVar[int]
    random: int
    def __init__(self, random: _Optional[int] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Data(_message.Message):
    __slots__ = ("connectID", "error", "data")
    CONNECTID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    connectID: int
    error: str
    data: bytes
    def __init__(self, connectID: _Optional[int] = ..., error: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...
