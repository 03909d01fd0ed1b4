"""The CPU extension: C++ sources (``csrc/``), their build (``extbuild``) and the model ops it replaces (``model_ops``)."""
