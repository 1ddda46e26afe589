"""Packaging for memory_saving_gradients.

TensorFlow is the user's own build, so it is an extra, not a requirement:
``pip install .[cpu]`` adds tensorflow-cpu, ``pip install .[gpu]`` adds
tensorflow[and-cuda]; plain ``pip install .`` never replaces an installed one.
"""

from setuptools import find_packages, setup

setup(
    name="memory_saving_gradients",
    version="0.1.0",
    description="Gradient checkpointing for TensorFlow 2 graphs: a drop-in tf.gradients "
    "that recomputes activations instead of storing them.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["memory_saving_gradients", "memory_saving_gradients.*",
                                    "test_models", "test_models.*"]),
    python_requires=">=3.9",
    install_requires=["numpy", "networkx", "toposort"],
    extras_require={
        "cpu": ["tensorflow-cpu>=2.16"],
        "gpu": ["tensorflow[and-cuda]>=2.16"],
        "test": ["pytest", "hypothesis", "networkx", "toposort"],
        "bench": ["matplotlib", "tqdm"],
    },
    license="MIT",
)
