"""Adapters that put Sandman under the frameworks RL and eval users already run:
mini-swe-agent (`minisweagent`), Harbor (`harbor`), inspect_ai (`inspect_ai`) and
SWE-ReX (`swerex`), one module each, each behind its extra
(``pip install 'sandman-rl[minisweagent]'``...)."""
