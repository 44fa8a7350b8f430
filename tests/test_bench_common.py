"""bench/common.py's machine facts: what a CPU figure depends on, read from the kernel's CPU description, so runs on
different kinds of core are never compared as if alike."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.common import machine_facts

AVX512_CORE = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse sse2 avx fma avx2 avx512f avx512bw avx512_bf16
"""
AVX2_CORE = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx fma avx2
processor\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 avx fma avx2
"""
ARM_CORE = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes
"""


def facts_of(tmp_path: Path, text: str) -> dict:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    return machine_facts(cpuinfo)


def test_the_widest_vector_instructions_come_first_and_each_once(tmp_path):
    wide = facts_of(tmp_path, AVX512_CORE)
    assert wide["cpu"] == "AMD EPYC 9R14"
    assert wide["vector"] == ["avx512f", "avx512_bf16", "avx2", "fma"]
    narrow = facts_of(tmp_path, AVX2_CORE)
    assert narrow["cpu"] == "AMD EPYC" and narrow["vector"] == ["avx2", "fma"]  # two cores listed, named once
    assert wide != narrow  # what tells the two sessions' machines apart


def test_an_arm_core_reports_its_features_and_a_missing_description_still_answers(tmp_path):
    assert facts_of(tmp_path, ARM_CORE)["vector"] == ["asimd"]
    missing = machine_facts(tmp_path / "absent")
    assert missing["vector"] == [] and missing["cpu"]  # the platform's name stands in
    assert missing["torch"] == torch.__version__ and missing["cores"] and missing["cores"] >= 1
