"""Monarch's ``monarch.actor.config``: process-wide switches a user sets by assignment."""

# Log records say which actor emitted them ("[actor=<root>.<module.Class name{point}>] ..."),
# as Monarch's do; False leaves messages as the code wrote them.
prefix_python_logs_with_actor = True
