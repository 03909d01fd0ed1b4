"""The dev kit: tools for developing and testing mlxq, not needed to serve.

``mlxq.devkit.make_model`` builds the small local test model (``mlxq make-model``, the tests, the
demo and the bench scripts) from the text of ``mlxq.devkit.corpus``.
"""
