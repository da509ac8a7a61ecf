"""Image folders (``<class>/<image>``) read into an :class:`ArrayDataset`: one mode and
one size for the whole folder, never resized silently; an unreadable file is named
with its fix. Pillow is imported only when a folder is read."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Final, Iterator

import numpy as np

from fldata.array_dataset import ArrayDataset, _check_split_size, _pad_28_to_32
from fldata.downloads import _require_module

_IMAGE_SUFFIXES: Final[frozenset[str]] = frozenset({".png", ".jpg", ".jpeg", ".bmp"})


class ImageFolderError(ValueError):
    """An image folder that cannot be used as it is; the message names the file and the fix."""


def _unreadable(path: Path, exc: BaseException) -> ImageFolderError:
    return ImageFolderError(
        f"{path} is not a readable image ({type(exc).__name__}: {exc}): the file is corrupt, truncated or not "
        f"an image; delete it or replace it with a good copy, then start again"
    )


@contextmanager
def _open_image(image_module, path: Path) -> Iterator:  # type: ignore[no-untyped-def]
    """``Image.open(path)``, with an unreadable file named and its fix given (never a bare PIL traceback)."""
    try:
        im = image_module.open(path)
    except (OSError, ValueError, SyntaxError) as exc:  # PIL.UnidentifiedImageError is an OSError
        raise _unreadable(path, exc) from exc
    with im:
        yield im


def _load_image_folder(directory: Path, name: str, id_offset: int) -> ArrayDataset:
    """Read ``directory/<class>/<image>``; classes are the sorted folder names."""
    _require_module("PIL", f"loading {name} image folders")
    from PIL import Image

    class_dirs = sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not class_dirs:
        raise FileNotFoundError(f"no class folders in {directory}; expected {directory}/<class>/<image>")
    files: list[Path] = []
    labels_list: list[int] = []
    for label, class_dir in enumerate(class_dirs):
        class_files = sorted(
            p for p in class_dir.iterdir() if p.is_file() and p.suffix.lower() in _IMAGE_SUFFIXES
        )
        files.extend(class_files)
        labels_list.extend([label] * len(class_files))
    if not files:
        raise FileNotFoundError(
            f"no images ({', '.join(sorted(_IMAGE_SUFFIXES))}) under the class folders of {directory}"
        )
    _check_split_size(len(files), str(directory))

    # First pass reads headers only (Image.open is lazy) to settle one mode and
    # one size for the whole folder; we never resize silently.
    modes: set[str] = set()
    size: tuple[int, int] | None = None
    first: Path | None = None
    for path in files:
        with _open_image(Image, path) as im:
            modes.add(im.mode)
            if size is None:
                size, first = im.size, path
            elif im.size != size:
                raise ImageFolderError(
                    f"image folder {directory} mixes image sizes: {path} is {im.size[0]}x{im.size[1]}, "
                    f"{first} and the images before it are {size[0]}x{size[1]}; every image of a device (and of the run) "
                    f"must have one size: resize {path} (or the others) first"
                )
    if size is None:  # unreachable: files is non-empty; narrows the type for checkers
        raise FileNotFoundError(f"no images under {directory}")
    mode = "L" if modes <= {"L", "1"} else "RGB"
    channels = 1 if mode == "L" else 3
    width, height = size
    images = np.empty((len(files), channels, height, width), dtype=np.uint8)
    for i, path in enumerate(files):
        with _open_image(Image, path) as im:
            try:
                arr = np.asarray(im.convert(mode), dtype=np.uint8)
            except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt pixel data
                raise _unreadable(path, exc) from exc
        images[i] = arr[None, :, :] if channels == 1 else arr.transpose(2, 0, 1)  # HWC -> CHW
    images = _pad_28_to_32(images)
    return ArrayDataset(
        images=np.ascontiguousarray(images),
        labels=np.asarray(labels_list, dtype=np.int64),
        sample_ids=np.arange(len(files), dtype=np.int64) + id_offset,
        num_classes=len(class_dirs),
        name=name,
        classes=tuple(p.name for p in class_dirs),
    )
