"""What a linear layer's product costs on this CPU by row count, with the kernel torch uses and with oneDNN's.

The shaped profile (app/pipeline/profiles.py) stands in for an H200, whose decode step is memory-bound: a step of
16 rows costs about one of 1 row. Whether a CPU keeps that property depends on its GEMM kernel at few rows, so this
times the shaped backbone's four products per layer (qkv, out, gate_up, down; fp32, one thread) at 1, 2, 4, 8, 16
and 32 rows two ways, one after the other at each row count, medians of `--repeats`:
  - `torch`: `torch.addmm(bias, W, x^T)`, the BLAS call (MKL on an x86 build) SlotDecoder's 16-row tiles made
    before the engine's linears moved to oneDNN (app/pipeline/music/torch_engine.Linear);
  - `onednn`: oneDNN's linear over a weight packed once (`torch.ops.mkldnn._reorder_linear_weight` and
    `_linear_pointwise`, what torch's CPU inductor uses for frozen weights, and torch_engine.Linear; private ops
    of torch 2.13).
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
from app.pipeline.profiles import load_profile

ROWS = (1, 2, 4, 8, 16, 32)


def shaped_layer_shapes() -> dict[str, tuple[int, int]]:
    """(out, in) of the shaped backbone's four products per layer, from its spec (app/pipeline/profiles.py)."""
    spec = load_profile("shaped", tempfile.mkdtemp()).backbone
    return {
        "qkv": ((spec.num_attention_heads + 2 * spec.num_query_groups) * spec.head_dim, spec.hidden_size),
        "out": (spec.hidden_size, spec.num_attention_heads * spec.head_dim),
        "gate_up": (2 * spec.ffn_hidden_size, spec.hidden_size),
        "down": (spec.hidden_size, spec.ffn_hidden_size),
    }


def timed_ms(work: Callable[[], object], repeats: int) -> float:
    work()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        samples.append(time.perf_counter() - started)
    return 1000 * statistics.median(samples)


def invariance(weights: list[torch.Tensor], packed: list[torch.Tensor], biases: list[torch.Tensor], trials: int):
    """(rows of a 16-row oneDNN product that differed from the same row among zeros at row 0, out of `trials`;
    rows that differed from their own 1-row product)."""
    moved = alone = 0
    for trial in range(trials):
        layer = trial % len(weights)
        width = weights[layer].shape[1]
        row = torch.randn(1, width)
        among_zeros = torch.cat([row, torch.zeros(15, width)])
        reference = torch.ops.mkldnn._linear_pointwise(among_zeros, packed[layer], biases[layer], "none", [], "")[0]
        mixed = torch.randn(16, width)
        mixed[trial % 16] = row[0]
        product = torch.ops.mkldnn._linear_pointwise(mixed, packed[layer], biases[layer], "none", [], "")
        moved += not torch.equal(product[trial % 16], reference)
        one = torch.ops.mkldnn._linear_pointwise(row, packed[layer], biases[layer], "none", [], "")[0]
        alone += not torch.equal(one, reference)
    return moved, alone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--layers", type=int, default=2, help="layers of the backbone (a frame's products)")
    parser.add_argument("--trials", type=int, default=200, help="rows checked for batch-invariance")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shapes = shaped_layer_shapes()
    weights = [torch.randn(out, width) * width**-0.5 for out, width in shapes.values()]
    biases = [torch.randn(out) for out, _ in shapes.values()]
    packed = [torch.ops.mkldnn._reorder_linear_weight(weight, 16) for weight in weights]
    per_frame = 2 * args.layers  # two tokens (q0, q1) a frame
    ms: dict[str, dict[int, float]] = {"torch": {}, "onednn": {}}
    for rows in ROWS:
        inputs = [torch.randn(rows, width) for _, width in shapes.values()]
        ms["torch"][rows] = per_frame * timed_ms(
            lambda inputs=inputs: [
                torch.addmm(b[:, None], w, x.t()) for w, b, x in zip(weights, biases, inputs, strict=True)
            ],
            args.repeats,
        )
        ms["onednn"][rows] = per_frame * timed_ms(
            lambda inputs=inputs: [
                torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")
                for p, b, x in zip(packed, biases, inputs, strict=True)
            ],
            args.repeats,
        )
    moved, alone = invariance(weights, packed, biases, args.trials)
    flops = 2 * sum(out * width for out, width in shapes.values()) * per_frame
    print(
        json.dumps(
            {
                "benchmark": "cpu_products",
                "torch": torch.__version__,
                "threads": 1,
                "layers": args.layers,
                "shapes": {name: list(shape) for name, shape in shapes.items()},
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
