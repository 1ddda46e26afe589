"""The benchmark's parts, one job each.

``core``: measure one model with one variant (peak, time, rewrite time,
predicted peak, gradients equal).  ``models``: the sweep's models and sizes.
``sweep``: every size x every variant, ratios to tf.gradients.  ``fits``: the
largest model under a memory cap.  ``training``: same loss curve with and
without memory-saving gradients.  ``report``: CSV, Markdown, PNG.  ``cli``:
``python -m memory_saving_gradients.benchmark``.
"""
