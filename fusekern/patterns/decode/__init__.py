"""The structural dequant -> matmul matcher (rewrite ``decode_matmul``).

- ``analysis``: find a matmul's weight decode cone in an FX graph and turn it into a decode program;
- ``program``: the decode program (one weight element as scalar code over sympy addresses), its text
  form and its torch evaluator;
- ``formats``: name the format a program computes (GPTQ, AWQ, MXFP4, ...);
- ``rewrite``: the graph rewrite, registered by ``fusekern.patterns.dequant_matmul``.
The kernels generated from a program live in ``fusekern.kernels.decode_mm``.
"""
