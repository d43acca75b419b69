"""Python effects of the step's code at capture: writes, host random draws, prints.

A graph replays kernels, never the Python that launched them; whatever else that Python did at
capture happens once and never again. Modules here watch the capturing call for such effects and
refuse them with the user's line and what to write instead.
"""
