"""Studies of the paper that run outside the training loop, each a package with its own command
(`python -m relaympi.studies.NAME`): quadratics, the random-quadratics studies on the matrix
engine (tuned steps to a target suboptimality, spanning trees, mean estimation)."""
