"""`python -m deepinfer`: the same as the `deepinfer` command."""

from deepinfer.cli.main import main

main()
