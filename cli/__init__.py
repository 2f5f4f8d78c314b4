"""The command line (`stagewise`, `python -m stagewise`): plan, recommend and inspect from a shell,
over the public API, so that a model can be planned for hardware without writing a script."""
