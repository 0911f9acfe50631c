# Minimal local stub for the parts of posix_ipc this project uses.
O_CREAT: int
O_EXCL: int
O_CREX: int
O_TRUNC: int

class Error(Exception): ...
class ExistentialError(Error): ...
class PermissionsError(Error): ...

class SharedMemory:
    name: str
    fd: int
    size: int
    mode: int
    def __init__(
        self,
        name: str | None,
        flags: int = ...,
        mode: int = ...,
        size: int = ...,
        read_only: bool = ...,
    ) -> None: ...
    def close_fd(self) -> None: ...
    def unlink(self) -> None: ...

def unlink_shared_memory(name: str) -> None: ...
