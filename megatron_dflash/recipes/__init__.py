"""Ready-made jobs on real models and data installed from the package registry (§7): the files they
find, the HF target they build from a GGUF, the prompt slices they take; no dependency on `training/`."""
