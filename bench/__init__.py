"""Benchmarks, load generators and GPU measurement harnesses (`pdserve bench`, `pdserve kvbench`,
`scripts/gpu-check`). Nothing in the product imports this package."""
