"""FlagError: a bench command's input refused, naming the flag and its value (`--only '3:0': ...`),
or a trace file's line.
`rollout-cluster` prints it as one line and exits 2, as argparse does its own refusals."""


class FlagError(ValueError):
    pass
