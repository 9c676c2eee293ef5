"""Benchmarks: each module's functions return dicts of measurements taken in one run;
`mirrorckpt bench` runs them and writes BENCHMARKS.md as ratios."""
