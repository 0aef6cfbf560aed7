"""The top floor: the `tandem` CLI and the `tandem serve` launcher, which know every role.

    cli         `tandem prefill|decode|gateway|serve|generate`: one subcommand per role
    launcher    `tandem serve`: gateway + N prefill + M decode as child processes on loopback
    supervisor  restarts the children of a `tandem serve` that exit, with backoff

Nothing below imports this package (ARCHITECTURE: no arrow runs back up).
"""
