"""The doctor's check of the agent's data: the directory, the dataset loads, and it
fits the run's contract (channels, image size, classes)."""

from __future__ import annotations

import os
from pathlib import Path

from .device import _user
from .network import EdgeConfigLike
from .report import FAIL, OK, Check


def data_fix(exc: BaseException) -> str:
    """What to do about data that does not load (doctor and ``edge-agent run`` say the same)."""
    from fldata.image_folder import ImageFolderError

    if isinstance(exc, ImageFolderError):
        return "fix the file(s) named above in this device's image folder ([data] root), then run doctor again"
    return "fix [data] in the config (docs/configuration.md)"


def check_data(config: "EdgeConfigLike", load: bool) -> Check:
    from fldata import load_dataset

    d = config.data  # type: ignore[attr-defined]
    if d.dataset in ("imagefolder", "cinic10", "npz"):
        if not d.root:
            return Check("data", FAIL, f"data.dataset = {d.dataset!r} needs data.root (the data directory)",
                         "set root = \"/var/lib/edgesplit/data\" in [data]")
        root = Path(os.path.expanduser(d.root))
        if not root.exists():
            return Check("data", FAIL, f"data directory {root} does not exist",
                         f"create it and put this device's data there (imagefolder: {root}/<class>/<image>.png; "
                         f"npz: {root}/train.npz from `python -m fldata.export`)")
        if not os.access(root, os.R_OK | os.X_OK):
            return Check("data", FAIL, f"data directory {root} is not readable by user {_user()}",
                         f"sudo chown -R {_user()} {root}")
    if not load:
        return Check("data", OK, f"{d.dataset} at {d.root or 'the default location'} (not loaded: --no-load-data)")
    try:
        train = load_dataset(d.dataset, "train", d.root, d.download)
        if d.dataset == "imagefolder" and d.root and (Path(os.path.expanduser(d.root)) / "test").is_dir():
            load_dataset(d.dataset, "test", d.root, d.download)  # the whole folder: a bad test image stops a run too
    except FileNotFoundError as exc:
        return Check("data", FAIL, f"the {d.dataset} training data is not there: {exc}",
                     "put the data in place (docs/deploy.md, 'Data on the device') or fix data.root")
    except (ValueError, OSError, ImportError) as exc:
        return Check("data", FAIL, f"cannot load {d.dataset} data: {exc}", data_fix(exc))
    if len(train) == 0:
        return Check("data", FAIL, f"{d.dataset} at {d.root} has no training samples", "add images")
    counts = train.class_counts()
    mismatch = contract_mismatch(d, tuple(int(x) for x in train.image_shape), int(train.num_classes))
    if mismatch:
        return Check("data", FAIL, f"{d.dataset} at {d.root}: this device's data does not fit the run: {'; '.join(mismatch)} "
                                   f"(the server refuses it at join)",
                     "make the folder fit the run: the same class folders on every device (as `python -m fldata.export "
                     "--format imagefolder` writes them), images of the run's size and channels; if the server's [server] "
                     "settings changed since edgesplit keys init, set the same in_channels / image_size / num_classes in [data]")
    folders = f", {train.num_classes} class folders" if d.dataset == "imagefolder" else ""
    return Check("data", OK, f"{d.dataset}: {len(train)} training images, {int((counts > 0).sum())} classes with images{folders}, "
                             f"shape {train.image_shape}")


def contract_mismatch(d: "DataConfigLike", shape: tuple[int, ...], num_classes: int) -> list[str]:
    """How data of ``shape`` (channels, height, width, as the model sees it) and ``num_classes``
    classes differs from the run's contract in ``[data]`` (in_channels, image_size,
    num_classes; 0 / unset are not checked), in words naming both sides."""
    out = []
    if d.in_channels and shape[0] != d.in_channels:
        out.append(f"its images have {shape[0]} channel(s), the run's in_channels is {d.in_channels}")
    if d.image_size and list(shape[1:]) != list(d.image_size):
        out.append(f"its images are {shape[1]}x{shape[2]} (height x width, as the model sees them), "
                   f"the run's image_size is {d.image_size[0]}x{d.image_size[1]}")
    if d.num_classes and num_classes != d.num_classes:
        what = "class folders" if d.dataset == "imagefolder" else "classes"
        out.append(f"it has {num_classes} {what}, the run's num_classes is {d.num_classes}")
    return out


class DataConfigLike:  # for type hints only (edge_agent.config.DataConfig)
    dataset: str
    in_channels: int
    image_size: list[int] | None
    num_classes: int
