"""What a linear layer's product costs on this CPU by row count, with the kernel torch uses and with oneDNN's.

The shaped profile (app/pipeline/profiles.py) stands in for an H200, whose decode step is memory-bound: a step of
16 rows costs about one of 1 row. Whether a CPU keeps that property depends on its GEMM kernel at few rows, so this
times the shaped backbone's four products per layer (qkv, out, gate_up, down; fp32, one thread) at 1, 2, 4, 8, 16
and 32 rows two ways, one after the other at each row count, medians of `--repeats`:
  - `torch`: `torch.addmm(bias, W, x^T)`, the BLAS call (MKL on an x86 build) SlotDecoder's 16-row tiles made
    before the engine's linears moved to oneDNN (app/pipeline/music/torch_engine.Linear);
  - `onednn`: the engine's own layers, torch_engine.Linear: oneDNN's linear over a weight packed once
    (`torch.ops.mkldnn._reorder_linear_weight` and `_linear_pointwise`, what torch's CPU inductor uses for frozen
    weights; private ops of torch 2.13).
The layers are the torch engine's Attention and FeedForward built from the shaped spec (random weights).
`row_ms` is a frame's products (2 tokens x `--layers` layers) per row; `vs_one_row` is a row count's cost over
1 row's. Also: whether a row of a 16-row oneDNN product is bitwise the same wherever it lies and whatever the other
rows hold (the batched engine's batch-invariance), and whether it equals that row's 1-row product. JSON on stdout.

    python bench/cpu_products.py [--repeats 20] [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine_facts
from app.pipeline.music.torch_engine import Attention, FeedForward, Linear, Shape
from app.pipeline.profiles import load_profile

ROWS = (1, 2, 4, 8, 16, 32)


def shaped_layers() -> dict[str, Linear]:
    """The shaped backbone's four linears of a layer, as the torch engine builds them from its spec (random
    weights): their own forward is the oneDNN product on this CPU, their weight what MKL's call reads."""
    shape = Shape.of(load_profile("shaped", tempfile.mkdtemp()).backbone)
    attention, ffn = Attention(shape), FeedForward(shape)
    layers = {"qkv": attention.qkv, "out": attention.out, "gate_up": ffn.gate_up, "down": ffn.down}
    for layer in layers.values():
        layer.requires_grad_(False)
    return layers


def timed_ms(work: Callable[[], object], repeats: int) -> float:
    work()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        samples.append(time.perf_counter() - started)
    return 1000 * statistics.median(samples)


def invariance(layers: list[Linear], trials: int) -> tuple[int, int]:
    """(rows of a 16-row oneDNN product that differed from the same row among zeros at row 0, out of `trials`;
    rows that differed from their own 1-row product)."""
    moved = alone = 0
    for trial in range(trials):
        layer = layers[trial % len(layers)]
        row = torch.randn(1, layer.in_features)
        reference = layer(torch.cat([row, torch.zeros(15, layer.in_features)]))[0]
        mixed = torch.randn(16, layer.in_features)
        mixed[trial % 16] = row[0]
        moved += not torch.equal(layer(mixed)[trial % 16], reference)
        alone += not torch.equal(layer(row)[0], reference)
    return moved, alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layers", type=int, default=2, help="layers of the backbone (a frame's products)")
    parser.add_argument("--trials", type=int, default=200, help="rows checked for batch-invariance")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    named = shaped_layers()
    layers = list(named.values())
    if not layers[0].packs(layers[0].weight):
        raise SystemExit("this torch build or CPU does not run oneDNN's packed linear (torch_engine.ONEDNN)")
    biases = [layer.bias if layer.bias is not None else torch.zeros(layer.out_features) for layer in layers]
    per_frame = 2 * args.layers  # two tokens (q0, q1) a frame
    ms: dict[str, dict[int, float]] = {"torch": {}, "onednn": {}}
    for rows in ROWS:
        inputs = [torch.randn(rows, layer.in_features) for layer in layers]
        ms["torch"][rows] = per_frame * timed_ms(
            lambda inputs=inputs: [
                torch.addmm(b[:, None], layer.weight, x.t()) for layer, b, x in zip(layers, biases, inputs, strict=True)
            ],
            args.repeats,
        )
        ms["onednn"][rows] = per_frame * timed_ms(
            lambda inputs=inputs: [layer(x) for layer, x in zip(layers, inputs, strict=True)], args.repeats
        )
    moved, alone = invariance(layers, args.trials)
    flops = 2 * sum(layer.out_features * layer.in_features for layer in layers) * per_frame
    print(
        json.dumps(
            {
                "benchmark": "cpu_products",
                "machine": machine_facts(),
                "threads": 1,
                "layers": args.layers,
                "shapes": {name: [layer.out_features, layer.in_features] for name, layer in named.items()},
                "load_average": [round(x, 2) for x in os.getloadavg()],
                "frame_ms": {kernel: {rows: round(v, 2) for rows, v in by.items()} for kernel, by in ms.items()},
                "row_ms": {kernel: {rows: round(v / rows, 3) for rows, v in by.items()} for kernel, by in ms.items()},
                "vs_one_row": {
                    kernel: {rows: round(v / by[1], 2) for rows, v in by.items()} for kernel, by in ms.items()
                },
                "gflops_at_16_rows": {kernel: round(16 * flops / by[16] / 1e6, 1) for kernel, by in ms.items()},
                "onednn_16_rows_vs_torch": round(ms["torch"][16] / ms["onednn"][16], 2),
                "onednn_tile_rows_moved_differ": f"{moved} of {args.trials}",
                "onednn_tile_row_vs_its_1_row_product_differ": f"{alone} of {args.trials}",
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
