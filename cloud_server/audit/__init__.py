"""The leakage audit's attacks: what the server can reconstruct from what crossed the wire.

- :mod:`~cloud_server.audit.scoring`: PSNR and SSIM against the private images in pixel
  space, and the mean-image baseline;
- :mod:`~cloud_server.audit.activations`: uploaded maps inverted through the extractor the
  server holds, or with its architecture only;
- :mod:`~cloud_server.audit.inverse_network`: a decoder trained on the server's public set;
- :mod:`~cloud_server.audit.updates`: weight updates inverted with the agents' local
  schedule unrolled;
- :mod:`~cloud_server.audit.labels`: label distributions from labels, logits and bias updates;
- :mod:`~cloud_server.audit.received`: decoded messages turned into the attacks' tensors;
- :mod:`~cloud_server.audit.registry`: which attacks apply to which method, and what the
  server is assumed to know.
"""

from .activations import (BEST_MAP_FIT, ArchitectureOnlyConfig, WhiteBoxConfig, invert_features_architecture_only,
                          invert_features_white_box, white_box_candidates)
from .errors import AttackInputError, AuditError, UnknownAuditMethodError, UnsupportedScheduleError
from .inverse_network import FeatureDecoder, InverseNetworkConfig, decode_features, train_inverse_network
from .labels import (LabelDistributionEstimate, histogram_error, label_histogram_from_bias_update,
                     label_histogram_from_labels, label_histogram_from_logits, true_histogram, uniform_guess_error)
from .received import ReceivedActivations, activations_from_messages, update_from_fedavg, update_from_fedkd
from .registry import (ATTACKS, PAYLOADS, AttackSpec, AuditPlan, MethodExposure, ServerKnowledge, attacks_for,
                       audited_methods, register_exposure)
from .scoring import MAX_PSNR_DB, ImageAttackOutcome, ImageScores, PixelSpace, mean_image_baseline, score_attack, score_images
from .schedule import LocalSchedule
from .updates import (UpdateInversionConfig, UpdateInversionResult, infer_single_label, invert_update,
                      last_linear_layer, unrolled_update)

__all__ = [
    "ATTACKS",
    "MAX_PSNR_DB",
    "PAYLOADS",
    "BEST_MAP_FIT",
    "ArchitectureOnlyConfig",
    "AttackInputError",
    "AttackSpec",
    "AuditError",
    "AuditPlan",
    "FeatureDecoder",
    "ImageAttackOutcome",
    "ImageScores",
    "InverseNetworkConfig",
    "LabelDistributionEstimate",
    "LocalSchedule",
    "MethodExposure",
    "PixelSpace",
    "ReceivedActivations",
    "ServerKnowledge",
    "UnknownAuditMethodError",
    "UnsupportedScheduleError",
    "UpdateInversionConfig",
    "UpdateInversionResult",
    "WhiteBoxConfig",
    "activations_from_messages",
    "attacks_for",
    "audited_methods",
    "decode_features",
    "histogram_error",
    "infer_single_label",
    "invert_features_architecture_only",
    "invert_features_white_box",
    "white_box_candidates",
    "invert_update",
    "label_histogram_from_bias_update",
    "label_histogram_from_labels",
    "label_histogram_from_logits",
    "last_linear_layer",
    "mean_image_baseline",
    "register_exposure",
    "score_attack",
    "score_images",
    "train_inverse_network",
    "true_histogram",
    "uniform_guess_error",
    "unrolled_update",
    "update_from_fedavg",
    "update_from_fedkd",
]
