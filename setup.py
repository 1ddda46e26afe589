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
        # What tf_keras and keras-hub import to build models from config (tests and the
        # Keras suite). tf-keras and keras-hub themselves are not listed: their metadata
        # asks for the full `tensorflow` wheel (keras-hub via tensorflow-text), which
        # would install a second TensorFlow over tensorflow-cpu. Install them with
        #   pip install --no-deps "tf-keras==<your TF major.minor>.*" "keras-hub==0.32.0"
        # as run_all_tests.sh does.
        "keras": ["keras>=3.15", "regex", "tokenizers"],
    },
    license="MIT",
)
