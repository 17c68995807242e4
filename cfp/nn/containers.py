"""Sequential and Residual: modules made of modules."""
from .module import Module


class Sequential(Module):
    def __init__(self, *modules):
        self.modules = list(modules)

    def children(self):
        return self.modules

    def forward(self, x):
        for m in self.modules:
            x = m.forward(x)
        return x

    def backward(self, dy):
        for m in reversed(self.modules):
            dy = m.backward(dy)
        return dy


class Residual(Module):
    """y = body(x) + shortcut(x), the shortcut being the identity or a module (a 1x1 projection
    convolution, usually with batch norm, when the body changes the shape). Both branches see
    and produce the same layout, so the sum is local."""

    def __init__(self, body, shortcut=None):
        self.body, self.shortcut = body, shortcut

    def children(self):
        return [self.body] + ([self.shortcut] if self.shortcut is not None else [])

    def forward(self, x):
        skip = x if self.shortcut is None else self.shortcut.forward(x)
        return self.body.forward(x) + skip

    def backward(self, dy):
        d_body = self.body.backward(dy)
        d_skip = dy if self.shortcut is None else self.shortcut.backward(dy)
        return d_body + d_skip
