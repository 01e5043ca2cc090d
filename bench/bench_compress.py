"""What zstd, with and without byte-grouping, does to trained weights and Adam moments, and what the product's
codec (``resilient_slurm.storage.encoding``, the durable tier's compressed shards) does with them.

    .venv/bin/python bench/bench_compress.py [--steps 600] [--repeats 3] [--dir DIR]

It trains a small causal transformer (bytes in, next byte out; 4 layers, d=256) with AdamW on real text, the
Python standard library's own sources, so the weights and moments are trained ones, not random numbers. It
then takes four groups of tensors: the fp32 weights, the same weights cast to bf16 (what a bf16 run keeps),
and the fp32 ``exp_avg`` and ``exp_avg_sq``. For each group and codec it reports the compressed size over
the raw size (the ratio; lower is better), and the encode and decode throughput on one thread (median of
``--repeats``; every round trip is checked byte for byte). "grouped" codecs first put byte ``j`` of every
element together (for bf16: all high bytes, then all low bytes; the exponent bytes then sit side by side),
as the issue asks. The baseline, measured in the same run: the disk's raw O_DIRECT write of the same bytes
(what a drain to POSIX costs without compression).

The "rslurm" rows are the product's own path, file to file: ``encoding.encode_file`` of the group's bytes
(in the page cache) into a compressed object with 1 and with 4 frame threads (the drain uses 4), and
``encoding.get_shard`` of that object back from a POSIX tier (decoded, checked against the xxh3), with 1
and 4 threads.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import page_buffer, raw_write, scratch_dir  # noqa: E402

MiB = 1 << 20


class Gpt(torch.nn.Module):
    """A byte-level causal transformer, small enough to train on two cores in a minute or two."""

    def __init__(self, d: int = 256, layers: int = 4, heads: int = 4, ctx: int = 128) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(256, d)
        self.pos = torch.nn.Embedding(ctx, d)
        layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, 256, bias=False)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(n)
        h = self.tok(x) + self.pos(torch.arange(n))
        return self.head(self.ln(self.blocks(h, mask=mask, is_causal=True)))


def corpus(limit: int = 64 * MiB) -> torch.Tensor:
    """The bytes of the standard library's .py files (real text), up to ``limit``."""
    root = os.path.dirname(os.__file__)
    parts, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:
            data = f.read()
        parts.append(data)
        total += len(data)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).long()


def train(steps: int, seed: int = 0) -> tuple[Gpt, torch.optim.Optimizer, float]:
    torch.manual_seed(seed)
    data = corpus()
    model = Gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - model.ctx - 1, (16,))
        x = torch.stack([data[s : s + model.ctx] for s in starts])
        y = torch.stack([data[s + 1 : s + model.ctx + 1] for s in starts])
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return model, opt, float(loss)


def groups(model: Gpt, opt: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    params = [p.detach() for p in model.parameters()]
    return {
        "weights fp32": params,
        "weights bf16": [p.to(torch.bfloat16) for p in params],
        "exp_avg fp32": [opt.state[p]["exp_avg"] for p in model.parameters()],
        "exp_avg_sq fp32": [opt.state[p]["exp_avg_sq"] for p in model.parameters()],
    }


def as_bytes(tensors: list[torch.Tensor]) -> tuple[bytes, int]:
    """The tensors' bytes back to back, and their element size."""
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors), tensors[0].element_size()


def group_bytes(data: bytes, k: int) -> bytes:
    """Byte j of every k-byte element together (a transpose of the (n, k) byte matrix)."""
    a = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return a.view(-1, k).t().contiguous().numpy().tobytes()


def ungroup_bytes(data: bytes, k: int) -> bytes:
    a = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return a.view(k, -1).t().contiguous().numpy().tobytes()


def codecs(zstd: object) -> dict[str, tuple[object, object]]:
    def plain(level: int) -> tuple[object, object]:
        def enc(data: bytes, k: int) -> bytes:
            return zstd.ZstdCompressor(level=level).compress(data)  # type: ignore[attr-defined]

        def dec(blob: bytes, k: int) -> bytes:
            return zstd.ZstdDecompressor().decompress(blob)  # type: ignore[attr-defined]

        return enc, dec

    def grouped(level: int) -> tuple[object, object]:
        def enc(data: bytes, k: int) -> bytes:
            return zstd.ZstdCompressor(level=level).compress(group_bytes(data, k))  # type: ignore[attr-defined]

        def dec(blob: bytes, k: int) -> bytes:
            return ungroup_bytes(zstd.ZstdDecompressor().decompress(blob), k)  # type: ignore[attr-defined]

        return enc, dec

    return {"zstd-1": plain(1), "zstd-3": plain(3), "grouped zstd-1": grouped(1), "grouped zstd-3": grouped(3)}


def product_rows(name: str, data: bytes, k: int, args: argparse.Namespace) -> list[dict[str, object]]:
    """The product's encode_file and get_shard on ``data`` (a file in the page cache), 1 and 4 threads."""
    import xxhash

    from resilient_slurm.storage import encoding
    from resilient_slurm.storage.posix import PosixTier

    d = scratch_dir(args.dir, "rslurm-bench-compress-")
    rows: list[dict[str, object]] = []
    try:
        src = os.path.join(d, "src")
        with open(src, "wb") as f:
            f.write(data)
        ck = xxhash.xxh3_64(data).hexdigest()
        os.makedirs(os.path.join(d, "tier"))
        for threads in (1, 4):
            te, td, size = [], [], 0
            for _ in range(args.repeats):
                dst = os.path.join(d, "tier", "obj")
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(dst)
                a = time.perf_counter()
                got = encoding.encode_file(src, dst, size=len(data), checksum=ck, stride=k, threads=threads)
                te.append(time.perf_counter() - a)
                if got is None:
                    raise AssertionError(f"{name}: the encoding was not smaller")
                size = got[0]
                out = os.path.join(d, "out")
                saved, encoding.ENCODE_THREADS = encoding.ENCODE_THREADS, threads
                try:
                    with PosixTier(os.path.join(d, "tier")) as tier:
                        a = time.perf_counter()
                        encoding.get_shard(tier, "obj", out, size=len(data), checksum=ck)
                        td.append(time.perf_counter() - a)
                finally:
                    encoding.ENCODE_THREADS = saved
                os.unlink(out)
            rows.append({"group": name, "codec": f"rslurm, {threads} thread{'s' if threads > 1 else ''}",
                         "bytes": len(data), "ratio": size / len(data),
                         "encode_gbps": len(data) / statistics.median(te) / 1e9,
                         "decode_gbps": len(data) / statistics.median(td) / 1e9, "grouping_share": 0.0})
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where to write (made if missing)")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    import zstandard as zstd
    t0 = time.perf_counter()
    model, opt, loss = train(args.steps)
    print(f"trained {args.steps} steps in {time.perf_counter() - t0:.0f} s, final loss {loss:.3f} "
          f"(ln 256 = 5.545 untrained); zstandard {zstd.__version__}, torch {torch.__version__}")
    results = []
    disk_gbps = []
    for name, tensors in groups(model, opt).items():
        data, k = as_bytes(tensors)
        _, mv = page_buffer(len(data))
        mv[: len(data)] = data
        path = os.path.join(args.dir, "rslurm-bench-compress.bin")
        try:
            raw = [raw_write(path, mv, 4)[0] for _ in range(args.repeats)]
        finally:
            os.unlink(path)
        disk_gbps.append(len(mv) / statistics.median(raw) / 1e9)
        for cname, (enc, dec) in codecs(zstd).items():
            te, td, size = [], [], 0
            for _ in range(args.repeats):
                a = time.perf_counter()
                blob = enc(data, k)  # type: ignore[operator]
                b = time.perf_counter()
                back = dec(blob, k)  # type: ignore[operator]
                c = time.perf_counter()
                if back != data:
                    raise AssertionError(f"{cname} did not round-trip {name}")
                te.append(b - a)
                td.append(c - b)
                size = len(blob)
            tg = []  # the byte-grouping alone (here a torch transpose with copies, not a tuned one)
            for _ in range(args.repeats if cname.startswith("grouped") else 0):
                a = time.perf_counter()
                group_bytes(data, k)
                tg.append(time.perf_counter() - a)
            results.append({"group": name, "codec": cname, "bytes": len(data), "ratio": size / len(data),
                            "encode_gbps": len(data) / statistics.median(te) / 1e9,
                            "decode_gbps": len(data) / statistics.median(td) / 1e9,
                            "grouping_share": statistics.median(tg) / statistics.median(te) if tg else 0.0})
        results += product_rows(name, data, k, args)
    disk = statistics.median(disk_gbps)
    print(f"\nraw O_DIRECT write of the same bytes (4 threads, fsync), median: {disk:.2f} GB/s\n")
    print("| group | codec | size | compressed / raw | encode GB/s (1 thread unless named) | of which grouping | decode GB/s "
          "| encode / disk write |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        share = f"{r['grouping_share']:.0%}" if r["grouping_share"] else "-"
        print(f"| {r['group']} | {r['codec']} | {r['bytes'] / MiB:.1f} MiB | {r['ratio']:.3f} | "
              f"{r['encode_gbps']:.2f} | {share} | {r['decode_gbps']:.2f} | {r['encode_gbps'] / disk:.2f} |")
    print("\n" + json.dumps({"disk_write_gbps": disk, "steps": args.steps, "loss": loss, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
