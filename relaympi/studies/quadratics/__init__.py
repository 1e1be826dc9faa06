"""Random-quadratics studies of the paper: tuned steps to a target suboptimality, spanning trees,
mean estimation.

    python -m relaympi.studies.quadratics STUDY [--quick] [--out DIR] [--seed S] [--seeds N]
                                                [--max-steps N]

    fig2           Figure 2: steps to 1e-6 vs n (ring, trees, exponential), over --seeds seeds
    heterogeneity  appendix "Independence of heterogeneity" (n=32 ring/chain)
    star           appendix "Star topology" (n=32)
    social         Figure 3: spanning trees of the social network
    dme            appendix "RelaySum for distributed mean estimation"
    lr-correction  appendix "Learning-rate correction", measured
    all            every study; `all --quick --out /tmp/q` runs them reduced (< 1 minute)

The quadratics are the paper's (relaympi.tasks.quadratics): f_i(x) = ||A_i x - b_i||^2 without a
1/2, zeta^2 and every target in that loss; each study's header prints that convention. Every
optimization study runs the matrix engine (relaympi.algorithms.matrix) with plain local SGD from
x(0) = 0 and tunes a constant learning rate per (method, setting): the one that reaches the
target suboptimality f(x_bar) - f* in the fewest steps, searched on a log scale
(tuning.SearchConfig: judged at log-spaced checkpoints, a rate whose suboptimality rises above the
target refused, as in the authors' code), with at most --max-steps gradient steps (default: the
study's, 20,000 or 10,000). A method that does not reach the target within the cap is reported as
"n.r." with the lowest suboptimality it reached (its plateau). With gradient noise, "reached"
means the suboptimality averaged over several noise streams (common to all learning rates) is
below the target. fig2 tunes every cell for each of --seeds problem seeds (--seed, --seed+1, ...;
default 10, --quick 2) and prints the median [min-max] over them.

Each study writes <out>/<study>.h5 (h5py) and prints its tables, the paper's findings that
hold or do not, and its wall time; fig2 also draws <out>/fig2.png (matplotlib, Agg). File
layout: root attributes `kind` ("quadratics-study"), `schema_version` (2; 1 had the 1/2 loss),
`quadratics_convention`, `study`, `settings` (JSON), `provenance` (JSON, relaympi.provenance),
`findings` (JSON list), `elapsed_s`; group `table` holds one dataset per column of the
study's table (one entry per row); `curves/<i>` holds row i's suboptimality per step at its
tuned learning rate and `trials/<i>` every learning rate its search tried [lr, steps to target
or -1, lowest suboptimality]; group `data` holds study-specific arrays (DME: MSE per checkpoint).

Modules: one per study (fig2, heterogeneity for "heterogeneity" and "star", social, dme,
lr_correction), each with its settings, run and findings; tuning (batched matrix-engine runs
and the log-scale learning-rate search); tuned (the problems, and the tune / log / row / table
step the optimization studies share); tables (plain-text tables, row
look-ups); findings (StudyResult, its HDF5 file and printed form); studies (the table of
studies and their --quick settings); __main__ (the command line). The DME estimators live in
relaympi.algorithms.dme_estimates.
"""
