"""Who holds what, and what moves between whom: one distributed convolution described rank by
rank, for learners (docs/design.md, section 9; scripts/explain.py).

tables: explain_layer and explain_model, from the layers' own layouts and messages, no MPI;
trace: trace_layer, the real layer under MPI beside its explanation; pictures: plot_layer and
plot_model (matplotlib).
"""
from .pictures import plot_layer, plot_model
from .tables import explain_layer, explain_model, model_table, range_text
from .trace import trace_layer

__all__ = ["explain_layer", "explain_model", "model_table", "plot_layer", "plot_model", "range_text", "trace_layer"]
