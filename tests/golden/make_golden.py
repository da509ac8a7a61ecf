"""Regenerate the golden frames and chunks. Only run this on a deliberate wire-format change
(bump PROTOCOL_VERSION, or CHUNK_VERSION for the chunk header, and document it in docs/protocol.md)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE.parent))

from shared_protocol.messages import encode_message  # noqa: E402
from test_chunking import golden_chunks  # noqa: E402
from test_frame import golden_round_start  # noqa: E402
from test_secagg_wire import golden_secagg_messages  # noqa: E402

(HERE / "round_start_v1.bin").write_bytes(encode_message(golden_round_start(), codecs={"weights": "raw"}))
(HERE / "round_start_zstd_v1.bin").write_bytes(encode_message(golden_round_start(), codecs={"weights": "zstd"}))
for name, msg in golden_secagg_messages().items():
    (HERE / name).write_bytes(encode_message(msg))
for seq, chunk in enumerate(golden_chunks()):
    (HERE / f"chunk_v2_seq{seq}.bin").write_bytes(chunk)
print("wrote", sorted(p.name for p in HERE.glob("*.bin")))
