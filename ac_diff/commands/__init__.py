"""One module per subcommand; each turns parsed arguments into library calls and an exit code."""
