from typing import Any

def scan(
    data: bytes, max_dims: int = 64, max_text_dims: int = 4096, max_string: int = 65536,
    max_entries: int = ..., max_built: int = ..., /
) -> dict[str, Any] | str | tuple[str] | None: ...
def check(data: bytes, /) -> str | None: ...
