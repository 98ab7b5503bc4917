"""Loads the captured frames in ../shared/wire as test vectors."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.wire.codec import WireFormat

FILES = {
    "sglang-0.5.23": WireFormat.SGLANG,
    "sglang-0.5.17": WireFormat.SGLANG_ARRAY,
    "vllm-0.33.0": WireFormat.VLLM,
}


@dataclass(frozen=True)
class Capture:
    name: str  # publisher name, e.g. "sglang-0.5.23"
    fmt: WireFormat  # its encoding
    data: dict[str, Any]  # the raw JSON

    def frames(self, batch: dict[str, Any]) -> list[bytes]:
        return [base64.b64decode(f) for f in batch["frames_b64"]]


def load(shared: Path, name: str) -> Capture:
    return Capture(name, FILES[name], json.loads((shared / "wire" / f"{name}.json").read_text()))
