"""The controller's laws, one module each; `control.controller` composes them per tick."""
