"""The reference run: the same script without AC, and every parameter's gradient compared with the run's.

    ac-diff run --reference no-ac train.py       # the recorded run, then the reference; `reference` section

`grads` captures gradients (bounded), `leaks` watches what reentrant regions drop, `forwards` records the
reference's first forward and compares it with the run's (why a first loss differs), `session` says where
a process writes, `run` starts the reference and builds the result, `compare` and `explain` make it,
`model` is the section, `child` is the reference process.
"""
