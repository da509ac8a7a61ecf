"""``python -m fldata.export``: write agents' shares of a dataset for devices.

Two formats:

* ``--format npz`` (default): one agent's share as ``train.npz`` / ``test.npz``, read
  with ``dataset = "npz"``, ``partition = "none"``. Sample ids are kept, so the shard
  is the same samples, with the same ids, as the simulated agent's.
* ``--format imagefolder``: image folders as a device with its own images has them,
  ``OUT/<device>/{train,test}/<class folder>/<sample id>.png`` for every agent (or
  ``OUT/{train,test}/...`` for one ``--index``), read with ``dataset = "imagefolder"``,
  ``partition = "none"``. Class folders get safe names that sort in class order
  (``0_T-shirt_top`` for "T-shirt/top" with 10 classes: a class name may hold a ``/``), every device
  gets every class folder (an empty one where its share has no image of the class, so
  that all devices count the same classes), and ``OUT/classes.json`` maps each class
  index to its name and folder. Images are written as they are fed to the model
  (Fashion-MNIST's 28x28 already padded to 32x32). Sample ids are not kept: an image
  folder numbers its files in sorted order.

The partition is computed here, with the same seeded spec a local simulation uses.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

from fldata.array_dataset import ArrayDataset
from fldata.npz_io import save_npz
from fldata.subsets import AgentDataSpec, load_agent_subset

FORMATS = ("npz", "imagefolder")


def class_folder_names(classes: tuple[str, ...], num_classes: int) -> list[str]:
    """One safe folder name per class, in class order, that also *sorts* in class order
    (image-folder loaders number classes by sorted folder name): ``NN_name`` with the index
    zero-padded and every character outside ``[A-Za-z0-9._-]`` replaced by ``_``."""
    names = list(classes) if len(classes) == num_classes else [str(i) for i in range(num_classes)]
    width = len(str(num_classes - 1))
    out = []
    for i, name in enumerate(names):
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "class"
        out.append(f"{i:0{width}d}_{safe}")
    return out


def write_image_folder(ds: ArrayDataset, directory: Path, folders: list[str]) -> int:
    """``directory/<class folder>/<sample id>.png`` for every image of ``ds`` (every class
    folder created, empty or not); returns the number of images written."""
    from PIL import Image

    for folder in folders:
        (directory / folder).mkdir(parents=True, exist_ok=True)
    for image, label, sample_id in zip(ds.images, ds.labels, ds.sample_ids):
        pixels = image[0] if image.shape[0] == 1 else np.ascontiguousarray(image.transpose(1, 2, 0))  # CHW -> HW(C)
        Image.fromarray(pixels).save(  # 2-D: mode L; (H, W, 3): RGB
            directory / folders[int(label)] / f"{int(sample_id)}.png")
    return len(ds)


def export_image_folders(
    dataset: str,
    out_dir: str | Path,
    partition: str = "iid",
    num_agents: int = 1,
    agent_index: int | None = None,
    seed: int = 0,
    root: str | None = None,
    train_samples: int = 0,
    test_samples: int = 0,
    names: tuple[str, ...] = (),
) -> list[Path]:
    """Image folders for the devices: ``out_dir/<name>/{train,test}/<class folder>/`` for
    every agent (names: ``names``, else ``agent-<i>``), or ``out_dir/{train,test}/...`` for
    ``agent_index`` alone; plus ``out_dir/classes.json``. Returns the device directories."""
    if names and len(names) != num_agents:
        raise ValueError(f"--names gives {len(names)} device names for --agents {num_agents}")
    spec = AgentDataSpec(dataset, partition, num_agents, seed, root, train_samples=train_samples, test_samples=test_samples)
    out = Path(out_dir)
    indices = range(num_agents) if agent_index is None else [agent_index]
    written: list[Path] = []
    folders: list[str] = []
    classes: tuple[str, ...] = ()
    for index in indices:
        train, test = load_agent_subset(spec, index)
        classes = train.classes
        folders = class_folder_names(train.classes, train.num_classes)
        device = out if agent_index is not None else out / (names[index] if names else f"agent-{index}")
        write_image_folder(train, device / "train", folders)
        write_image_folder(test, device / "test", folders)
        written.append(device)
    named = list(classes) if len(classes) == len(folders) else [str(i) for i in range(len(folders))]
    # The run's data contract for these folders: what the server's [server] must say (or keys init's
    # --in-channels / --image-size / --num-classes), as the model sees the images (28x28 padded to 32x32).
    channels, height, width = (int(d) for d in train.image_shape)
    (out / "classes.json").write_text(json.dumps(
        {"dataset": dataset, "in_channels": channels, "image_size": [height, width], "num_classes": len(folders),
         "classes": [{"index": i, "name": n, "folder": f} for i, (n, f) in enumerate(zip(named, folders))]},
        indent=2) + "\n")
    return written


def export_partition(
    dataset: str,
    out_dir: str | Path,
    partition: str = "iid",
    num_agents: int = 1,
    agent_index: int = 0,
    seed: int = 0,
    root: str | None = None,
    train_samples: int = 0,
    test_samples: int = 0,
) -> tuple[Path, Path]:
    """Write ``out_dir/train.npz`` and ``out_dir/test.npz`` for one agent; returns their paths."""
    spec = AgentDataSpec(dataset, partition, num_agents, seed, root, train_samples=train_samples, test_samples=test_samples)
    train, test = load_agent_subset(spec, agent_index)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_npz(train, out / "train.npz")
    save_npz(test, out / "test.npz")
    return out / "train.npz", out / "test.npz"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fldata.export", description=__doc__.splitlines()[0])
    p.add_argument("--dataset", required=True)
    p.add_argument("--root")
    p.add_argument("--partition", default="iid", help="iid | dirichlet:A | step:K | table:path.csv | none")
    p.add_argument("--agents", type=int, default=1)
    p.add_argument("--index", type=int, default=0, help="this agent's index in the partition")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-samples", type=int, default=0)
    p.add_argument("--test-samples", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--format", choices=FORMATS, default="npz",
                   help="npz: one agent's train.npz / test.npz; imagefolder: PNG folders per device, with classes.json")
    p.add_argument("--names", help="imagefolder: comma-separated device names for the folders (default agent-0, agent-1, ...)")
    args = p.parse_args(argv)
    if args.format == "imagefolder":
        index = args.index if "--index" in (argv if argv is not None else sys.argv[1:]) else None
        try:
            devices = export_image_folders(args.dataset, args.out, args.partition, args.agents, index, args.seed, args.root,
                                           args.train_samples, args.test_samples,
                                           tuple(n.strip() for n in args.names.split(",") if n.strip()) if args.names else ())
        except (ValueError, FileNotFoundError) as exc:
            print(f"fldata.export: error: {exc}", file=sys.stderr)
            return 2
        for device in devices:
            print(f"wrote {device}/train and {device}/test")
        print(f"class folders and names: {Path(args.out) / 'classes.json'}")
        meta = json.loads((Path(args.out) / "classes.json").read_text())
        c, (h, w), k = meta["in_channels"], meta["image_size"], meta["num_classes"]
        print(f"the run's data contract for these images: edgesplit keys init --in-channels {c} --image-size {h}x{w} "
              f"--num-classes {k} (or [server] in_channels = {c}, image_size = [{h}, {w}], num_classes = {k})")
        return 0
    try:
        train, test = export_partition(args.dataset, args.out, args.partition, args.agents, args.index, args.seed,
                                       args.root, args.train_samples, args.test_samples)
    except (ValueError, FileNotFoundError) as exc:
        print(f"fldata.export: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {train} and {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
