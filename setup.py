"""megatron-dflash: train DFlash block-diffusion draft models on megatron-core."""

from setuptools import find_packages, setup

setup(
    name="megatron-dflash",
    version="0.1.0",
    description="Megatron-Core extension that trains DFlash block-diffusion draft models for speculative decoding",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["megatron_dflash", "megatron_dflash.*"]),
    # The trained tiny target of the embedded job (a few MB; tools/build_tiny_target.py rebuilds it).
    package_data={"megatron_dflash": ["assets/tiny_target/*"]},
    python_requires=">=3.10",
    install_requires=[
        # Pinned to the tested version. On CPU-only machines install the CPU wheel first (see README):
        # from the default index this version resolves to the CUDA build and its nvidia-* wheels.
        "torch==2.13.0",
        "megatron-core>=0.16,<0.17",
        "transformers>=4.57",
        "safetensors>=0.4",
        "numpy",
        "psutil",
        "matplotlib",  # the run directory's metrics.png
    ],
    extras_require={
        # scipy: the statistical test of speculative sampling (chi-square against the target's distribution)
        # datasets: Parquet and save_to_disk data (the data tests of those formats skip without it)
        # gguf: a tiny GGUF target written and converted to a HF directory (recipes/gguf_target.py)
        "test": ["pytest>=8", "hypothesis>=6", "scipy", "datasets", "gguf"],
        # the real-target job's GGUF conversion (recipes/gguf_target.py)
        "gguf": ["gguf"],
        # Parquet and save_to_disk training data (data/formats.py reads them through datasets)
        "data": ["datasets"],
        # GPU only. Never install on CPU machines: its meta package breaks megatron imports.
        "te": ["transformer-engine[pytorch]"],
        # The published readers and writers of drafters, for parity checks: the z-lab reference
        # modeling code, NeMo AutoModel and SpecForge. The tests use only their modeling code,
        # which needs torch and transformers: CI installs them with `pip install --no-deps`.
        "interop": ["dflash==0.1.0", "nemo-automodel==0.7.0", "specforge==0.2.0"],
    },
    entry_points={
        "console_scripts": [
            "megatron-dflash-convert = megatron_dflash.checkpoint.convert:main",
        ],
    },
)
