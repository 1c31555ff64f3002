"""Layer 9: one module per `edge-agent` subcommand: `add_arguments(parser)` and `main(args) -> int`."""
