"""What PipeDream's SOSP'19 paper reports: its hand-made plans, its Table 1 as commonly
quoted, and what could be verified of it here."""

from __future__ import annotations

import dataclasses

#: PipeDream's 15-1 for VGG-16 and AlexNet on 16 GPUs, as msr-fiddle/pipedream ships it
#: (runtime/image_classification/models/*/gpus=16/hybrid_conf.json and stage1.py: stage 1
#: is the fully connected layers, from the first Linear on), in pdjax's layer indices of
#: the same profiles: (first layer, last layer, replicas).
PAPER_PLANS = {
    "vgg16": ((0, 33, 15), (34, 40, 1)),
    "alexnet": ((0, 16, 15), (17, 22, 1)),
}


@dataclasses.dataclass(frozen=True)
class PaperResult:
    """What PipeDream's SOSP'19 paper (Table 1) reports for a model on a cluster."""

    config: str
    speedup: str
    source: str


_UNVERIFIED = "not verified: Table 1 of the paper could not be read here"
PAPER = {
    ("vgg16", "4x4-v100-10gbps"): PaperResult(
        "15-1",
        "5.28x (not verified)",
        "config verified (repository's gpus=16 hybrid_conf.json, run on 4 servers x 4); "
        f"speedup {_UNVERIFIED}; the abstract's 'up to 5.3x' is consistent with it",
    ),
    ("vgg16", "2x8-v100-25gbps"): PaperResult(
        "15-1", "2.98x (not verified)", f"config as the repository's 16-GPU one; {_UNVERIFIED}"
    ),
    ("alexnet", "4x4-v100-10gbps"): PaperResult(
        "15-1",
        "4.92x (not verified; synthetic data, throughput)",
        "config verified (repository's gpus=16 hybrid_conf.json); speedup " + _UNVERIFIED,
    ),
    ("alexnet", "2x8-v100-25gbps"): PaperResult(
        "15-1", "2.04x (not verified)", f"config as the repository's 16-GPU one; {_UNVERIFIED}"
    ),
    ("resnet50", "4x4-v100-10gbps"): PaperResult(
        "16 (DP)",
        "1x (not verified)",
        "the repository's driver configs run ResNet-50 on 16 GPUs as DP only "
        "(resnet50_16dp.yml; its unused gpus=16 hybrid_conf.json is 8-4-4); " + _UNVERIFIED,
    ),
    ("resnet50", "2x8-v100-25gbps"): PaperResult("16 (DP)", "1x (not verified)", _UNVERIFIED),
    ("gnmt", "4x4-v100-10gbps"): PaperResult(
        "no 16-GPU GNMT-8 row",
        "GNMT-8 on 3x4: straight, 2.95x (not verified)",
        "the repository's 12-GPU GNMT-8 config is 1-1-1-1-1-1-1-1-3-1 (verified); " + _UNVERIFIED,
    ),
    ("gnmt", "2x8-v100-25gbps"): PaperResult("16 (DP)", "1x (not verified)", _UNVERIFIED),
}


@dataclasses.dataclass(frozen=True)
class Table1Row:
    """One row of the SOSP'19 paper's Table 1 as commonly quoted (not verified here)."""

    model: str  # as the paper names it
    profile: str | None  # ``pipedream:NAME``'s NAME; None: no published profile
    cluster: str  # pdjax's topology preset
    servers: str  # servers x GPUs and the paper's cluster
    config: str
    speedup: str
    note: str = ""  # after "not verified"


TABLE1 = (
    Table1Row("VGG-16", "vgg16", "4x4-v100-10gbps", "4x4 (A)", "15-1", "5.28x"),
    Table1Row("VGG-16", "vgg16", "2x8-v100-25gbps", "2x8 (B)", "15-1", "2.98x"),
    Table1Row("ResNet-50", "resnet50", "4x4-v100-10gbps", "4x4 (A)", "16 (DP)", "1x"),
    Table1Row("ResNet-50", "resnet50", "2x8-v100-25gbps", "2x8 (B)", "16 (DP)", "1x"),
    Table1Row(
        "AlexNet",
        "alexnet",
        "4x4-v100-10gbps",
        "4x4 (A)",
        "15-1",
        "4.92x",
        "synthetic data, throughput",
    ),
    Table1Row("AlexNet", "alexnet", "2x8-v100-25gbps", "2x8 (B)", "15-1", "2.04x"),
    Table1Row("GNMT-16", "gnmt_large", "1x4-v100-10gbps", "1x4 (A)", "straight", "1.46x"),
    Table1Row("GNMT-16", "gnmt_large", "4x4-v100-10gbps", "4x4 (A)", "straight", "2.34x"),
    Table1Row("GNMT-16", "gnmt_large", "2x8-v100-25gbps", "2x8 (B)", "straight", "3.14x"),
    Table1Row("GNMT-8", "gnmt", "1x4-v100-10gbps", "1x4 (A)", "straight", "1.5x"),
    Table1Row("GNMT-8", "gnmt", "3x4-v100-10gbps", "3x4 (A)", "straight", "2.95x"),
    Table1Row("GNMT-8", "gnmt", "2x8-v100-25gbps", "2x8 (B)", "16 (DP)", "1x"),
    Table1Row("AWD-LM", None, "1x4-v100-10gbps", "1x4 (A)", "straight", "4.25x"),
)


#: msr-fiddle/pipedream's 12-GPU GNMT-8 configuration (verified; see the paper column).
GNMT8_12_GPUS = "1-1-1-1-1-1-1-1-3-1"
