"""Benchmarks (``make bench``): ConceptMoE vs its matched plain MoE, and our MoE layer vs transformers'."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
