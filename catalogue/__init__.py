"""The device catalogue, not IR: accelerator kinds and cloud instance types with their sourced figures
(entries.py, data.json), the files users add (files.py), and device requests like "8xH100" (requests.py).
It imports only the IR; the compiler and the command line read it."""
