"""Scripts run by hand: the fuzz campaign, the fault report, generated code and vectors, the demo pair."""
