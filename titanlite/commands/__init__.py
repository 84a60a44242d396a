"""Layer 6, the entry points: the torchrun worker (train), eval, generate, check, convert, the launcher and the
`titanlite` command line. Nothing imports them but the command line and the tools beside them."""
