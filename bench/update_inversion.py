"""Update inversion on the project's models at the agents' local schedules: per model x
optimiser x batch size x local steps, the reconstructions' PSNR / SSIM beside the
mean-image baseline, over several seeds (each seed draws the global model, the private
images and the attack's starting noise).

An agent's update is simulated as the agents train (models.optimizers, BatchNorm in train
mode, the running statistics uploaded with the weights); its images are the first of a seeded
Fashion-MNIST training subset, the server's public set a test subset. One image's label is
read from its update; larger batches are given their labels (Inverting Gradients' setting).

    OMP_NUM_THREADS=1 python bench/update_inversion.py            # the committed grid
    OMP_NUM_THREADS=1 python bench/update_inversion.py --models resnet8 --cells 1x1 --variants strong
    OMP_NUM_THREADS=1 python bench/update_inversion.py --models resnet8 --optimizers adam --cells 64x1 \
        --old-variant-cells "" --images 64 --append   # the agents' default batch, added
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import operator
import time
from pathlib import Path
from typing import Any

from _common import RESULTS, machine, write_json

import torch
import torch.nn.functional as F

from cloud_server.audit import LocalSchedule, PixelSpace, UpdateInversionConfig, invert_update
from cloud_server.audit.audit_updates import image_row, match_private
from fldata import seeded_subset
from models.optimizers import make_optimizer
from models.registry import build_model

FASHION = PixelSpace.of_dataset("fashion-mnist", 1)
#: The attack as it was (cosine through the unrolled schedule, softened Adam, one start) and
#: as it is now (UpdateInversionConfig's defaults: the sign for one Adam step, BatchNorm's
#: running statistics, two restarts).
VARIANTS: dict[str, dict[str, Any]] = {
    "cosine": dict(match="cosine", batchnorm_weight=0.0, restarts=1),
    "strong": {},
}
#: The agents' defaults (FedAvgRoundConfig): Adam (AMSGrad) at 0.001; SGD with the default momentum.
OPTIMIZERS = {"adam": dict(lr=0.001, optimizer="adam", weight_decay=1e-4),
              "sgd": dict(lr=0.01, optimizer="sgd", momentum=0.9, weight_decay=1e-4)}


def agent_update(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, schedule: LocalSchedule) -> dict[str, torch.Tensor]:
    """``uploaded - global`` for every float tensor of the state (running statistics included)."""
    trained = copy.deepcopy(model).train()
    optimizer = make_optimizer(schedule.optimizer, trained.parameters(), schedule.lr, momentum=schedule.momentum,
                               weight_decay=schedule.weight_decay)
    for step in range(schedule.local_steps):
        index = torch.arange(step * schedule.batch_size, (step + 1) * schedule.batch_size) % images.shape[0]
        output = trained(FASHION.to_model(images[index]))
        optimizer.zero_grad()
        F.cross_entropy(output[0] if isinstance(output, tuple) else output, labels[index]).backward()
        optimizer.step()
    start = model.state_dict()
    return {k: (v - start[k]).detach() for k, v in trained.state_dict().items() if v.dtype.is_floating_point}


def run_cell(model_name: str, optimizer: str, batch: int, steps: int, variant: str, seed: int, images_per_cell: int,
             attack_steps: int) -> dict[str, Any]:
    per_update = batch * steps
    updates = max(1, images_per_cell // per_update)
    train, test = seeded_subset("fashion-mnist", train_samples=max(100, updates * per_update), test_samples=200, seed=seed)
    private_all = torch.from_numpy(train.images.astype("float32") / 255.0)
    labels_all = torch.from_numpy(train.labels.copy()).long()
    public = torch.from_numpy(test.images.astype("float32") / 255.0)
    model = build_model(model_name, 10, 1, generator=torch.Generator().manual_seed(seed))
    schedule = LocalSchedule(local_steps=steps, batch_size=batch, **OPTIMIZERS[optimizer])
    config = UpdateInversionConfig(steps=attack_steps, seed=seed, **VARIANTS[variant])
    reconstructed, private, wall_s, labels_right = [], [], 0.0, True
    for u in range(updates):
        images, labels = private_all[u * per_update:(u + 1) * per_update], labels_all[u * per_update:(u + 1) * per_update]
        update = agent_update(model, images, labels, schedule)
        started = time.perf_counter()
        result = invert_update(model, update, FASHION, (1, 32, 32), per_update, schedule,
                               labels=None if per_update == 1 else labels, start=public.mean(0), config=config)
        wall_s += time.perf_counter() - started
        labels_right &= result.labels.tolist() == labels.tolist()
        reconstructed.append(result.images)
        private.append(match_private(result.images, images))
    return image_row("update_inversion", torch.cat(reconstructed), torch.cat(private), public, wall_s, model=model_name,
                     optimizer=optimizer, batch_size=batch, local_steps=steps, variant=variant, seed=seed,
                     images_per_update=per_update, updates=updates, labels="read from the update" if per_update == 1 else "given",
                     labels_right=labels_right, attack_steps=attack_steps, config=dataclasses.asdict(config))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet8,resnet56")
    parser.add_argument("--optimizers", default="adam,sgd")
    parser.add_argument("--cells", default="1x1,2x1,4x1,8x1,1x4",
                        help="BATCHxSTEPS per update: STEPS local steps of BATCH images (an epoch over BATCH*STEPS images)")
    parser.add_argument("--variants", default="strong")
    parser.add_argument("--old-variant-cells", default="1x1", help="cells also run with the old attack ('cosine')")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--images", type=int, default=1, help="private images per cell and seed (at least one update)")
    parser.add_argument("--attack-steps", type=int, default=200)
    parser.add_argument("--max-images-resnet56", type=int, default=1, help="skip larger updates of ResNet-56 (time)")
    parser.add_argument("--out", default=str(RESULTS / "update_inversion.json"))
    parser.add_argument("--append", action="store_true",
                        help="keep --out's rows, replacing those of the cells run again (their args kept under 'runs')")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    started = time.perf_counter()
    for model_name in args.models.split(","):
        for optimizer in args.optimizers.split(","):
            for cell in args.cells.split(","):
                batch, steps = map(int, cell.split("x"))
                if model_name == "resnet56" and batch * steps > args.max_images_resnet56:
                    continue
                variants = args.variants.split(",") + (["cosine"] if cell in args.old_variant_cells.split(",") else [])
                for variant in dict.fromkeys(variants):
                    for seed in map(int, args.seeds.split(",")):
                        row = run_cell(model_name, optimizer, batch, steps, variant, seed, args.images, args.attack_steps)
                        rows.append(row)
                        print(f"{model_name:9s} {optimizer:4s} b={batch} steps={steps} {variant:6s} seed={seed}: "
                              f"{row['psnr_db']:.1f} dB (baseline {row['baseline_psnr_db']:.1f}), "
                              f"SSIM {row['ssim']:.3f} (baseline {row['baseline_ssim']:.3f}), {row['wall_s']:.0f} s", flush=True)
    runs, out = [{"machine": machine(), "args": vars(args), "total_wall_s": time.perf_counter() - started}], Path(args.out)
    if args.append and out.exists():
        previous = json.loads(out.read_text())
        key = operator.itemgetter("model", "optimizer", "batch_size", "local_steps", "variant", "seed")
        new_keys = {key(row) for row in rows}
        rows = [row for row in previous["rows"] if key(row) not in new_keys] + rows
        runs = previous["runs"] + runs
    write_json(out, {"benchmark": "update_inversion", **runs[0], "runs": runs, "rows": rows})


if __name__ == "__main__":
    main()
