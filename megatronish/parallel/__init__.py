"""Parallelism: degrees and groups, comm primitives, tensor-parallel layers, RNG. Knows nothing of GPT."""
