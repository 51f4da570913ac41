"""Use cases: the rules every face (the `pdserve` CLI, the KFP steps, the Argo workflows) applies the same way.

A use case takes typed values and callables for storage, returns a typed outcome, and never prints or exits.
"""
