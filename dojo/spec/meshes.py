"""What the specs of the 2-D mesh katas (k28's FSDP x TP, k36's HSDP) share: a mesh of rows and
columns on 4 ranks, its groups' members and sums, its refusals, and the group each collective ran
on, told in each kata's names (``Grid``: the mesh's class, its outer and inner axes).

Grid.fields                        the attributes a mesh must have
Grid.facts(kata, rank, meshes)     in a rank: each mesh's indices, members, sizes, sums; refusals
Grid.check_groups(results, o, i)   every rank's indices, then members, sizes and sums held
Grid.check_refusals(refused)       each misfit refused with a ValueError, before any call
Grid.kinds(calls, mesh)            each recorded collective: its kind and its group's axis
failed(rank, what, error)          a rank's error, said in a line
"""

from __future__ import annotations

from dataclasses import dataclass

from dojo.spec import collectives

WORLD = 4
MISFITS = ((3, 2), (2, 1), (0, 4), (4, 0))  # (outer, inner) that do not make 4 ranks


def failed(rank: int, what: str, error: Exception) -> str:
    return f"rank {rank}: {what} raised {type(error).__name__}: {str(error).strip()[:400]}"


@dataclass(frozen=True)
class Grid:
    """A kata's mesh: ``name`` its class, ``outer`` the axis down a column (rank // inner),
    ``inner`` the one along a row; ``row``/``column`` what a row and a column hold, in the
    kata's words (empty: not said)."""

    name: str
    outer: str
    inner: str
    row: str = ""
    column: str = ""

    @property
    def fields(self) -> tuple[str, ...]:
        o, i = self.outer, self.inner
        return (
            o,
            i,
            f"{o}_index",
            f"{i}_index",
            f"{i}_group",
            f"{o}_group",
            f"{i}_ranks",
            f"{o}_ranks",
        )

    def _get(self, mesh, what: str):
        """``what`` of the mesh: "row" or "column" with a suffix, in the kata's names."""
        axis, _, suffix = what.partition("_")
        return getattr(mesh, f"{self.inner if axis == 'row' else self.outer}_{suffix}")

    def facts(self, kata, rank: int, meshes) -> dict:
        """In a rank: for each (outer, inner) of ``meshes``, what ``kata.make_mesh`` made of it;
        under "refused", what it did with each of ``MISFITS`` (None: returned a mesh)."""
        import torch
        import torch.distributed as dist

        from dojo.harness.calls import recording
        from dojo.todo import KataTodo

        out = {}
        for outer, inner in meshes:
            mesh = kata.make_mesh(outer, inner)
            lacks = [name for name in self.fields if not hasattr(mesh, name)]
            if lacks:
                raise AssertionError(
                    f"make_mesh({outer}, {inner}) returned {mesh!r}, which has no "
                    f"{', '.join(lacks)}: return the {self.name} written for you, "
                    f"{self.name}({', '.join(self.fields)})"
                )
            row_group, column_group = self._get(mesh, "row_group"), self._get(mesh, "column_group")
            # all-reduce over the groups only when every rank is in its own row and column: a
            # rank outside the group it was given would leave its peers waiting for ever
            indices = (self._get(mesh, "column_index"), self._get(mesh, "row_index"))
            fits = indices == divmod(rank, inner) and all(
                group is not None and rank in dist.get_process_group_ranks(group)
                for group in (row_group, column_group)
            )
            agree = torch.tensor([1.0 if fits else 0.0])
            dist.all_reduce(agree, op=dist.ReduceOp.MIN)
            row, column = torch.tensor([float(rank)]), torch.tensor([float(rank)])
            if agree.item() == 1.0:
                dist.all_reduce(row, group=row_group)
                dist.all_reduce(column, group=column_group)
            out[(outer, inner)] = {
                "indices": indices,
                "ranks": (
                    list(self._get(mesh, "row_ranks")),
                    list(self._get(mesh, "column_ranks")),
                ),
                "sizes": (dist.get_world_size(row_group), dist.get_world_size(column_group)),
                "sums": (row.item(), column.item()),
            }
        refused = {}
        for outer, inner in MISFITS:
            with recording() as calls:
                try:
                    kata.make_mesh(outer, inner)
                    refused[(outer, inner)] = None
                except KataTodo:
                    raise
                except Exception as error:  # what a learner's version raised, as it raised it
                    refused[(outer, inner)] = (type(error).__name__, str(error), len(calls))
        out["refused"] = refused
        return out

    def check_groups(self, results: list[dict], outer: int, inner: int) -> None:
        """Every rank's ``facts`` of the ``outer x inner`` mesh: indices first, then members,
        sizes, sums, so that a mistake shows as the narrowest thing it breaks."""
        o, i = self.outer, self.inner
        name = f"a {outer} x {inner} mesh"

        def expected(rank):
            r, s = divmod(rank, inner)
            return r, s, list(range(r * inner, (r + 1) * inner)), list(range(s, WORLD, inner))

        for rank, got in enumerate(results):
            r, s, _, _ = expected(rank)
            assert got["indices"] == (r, s), (
                f"rank {rank} of {name} says ({o}_index, {i}_index) = {got['indices']}, expected "
                f"{(r, s)}: rank = {o}_index * {i} + {i}_index (torch's init_device_mesh lays a "
                f"({o}, {i}) mesh out so), so {o}_index = rank // {i} and {i}_index = rank % {i}"
            )
        row_is = f" ({self.row})" if self.row else ""
        column_is = f" ({self.column})" if self.column else ""
        for rank, got in enumerate(results):
            _, _, row, column = expected(rank)
            assert got["ranks"] == (row, column), (
                f"rank {rank} of {name} lists {i}_ranks {got['ranks'][0]} and {o}_ranks "
                f"{got['ranks'][1]}, expected its row {row}{row_is} and its column "
                f"{column}{column_is}"
            )
        for rank, got in enumerate(results):
            assert got["sizes"] == (inner, outer), (
                f"rank {rank} of {name}: its {i} group has {got['sizes'][0]} ranks and its {o} "
                f"group {got['sizes'][1]}, expected {inner} (the row) and {outer} (the column): "
                f"{i}_group and {o}_group swapped?"
            )
        for rank, got in enumerate(results):
            _, _, row, column = expected(rank)
            assert got["sums"] == (float(sum(row)), float(sum(column))), (
                f"rank {rank} of {name}: an all-reduce of the ranks over {i}_group gave "
                f"{got['sums'][0]} and over {o}_group {got['sums'][1]}, expected {sum(row)} (row "
                f"{row}) and {sum(column)} (column {column}): the groups do not hold those ranks "
                "(or some rank is not in the groups it was given)"
            )

    def check_refusals(self, refused: dict) -> None:
        """``facts``' "refused": each misfit a ValueError naming the world size, raised before
        any call of torch.distributed."""
        o, i = self.outer, self.inner
        for (outer, inner), got in refused.items():
            said = f"make_mesh({outer}, {inner}) on {WORLD} ranks"
            assert got is not None, (
                f"{said} returned a mesh: raise ValueError ({o} x {i} must be the world size, "
                "each at least 1)"
            )
            kind, message, calls = got
            assert kind == "ValueError", (
                f"{said} raised {kind}: {message[:200]}; check first and raise ValueError, saying "
                f"{o} x {i} must equal the world size"
            )
            if outer >= 1 and inner >= 1:
                assert str(WORLD) in message, (
                    f"{said}'s ValueError says {message!r}: name the world size ({WORLD}), so "
                    f"that the reader knows what {o} x {i} must be"
                )
            assert calls == 0, (
                f"{said} made {calls} call(s) of torch.distributed before its ValueError: check "
                "the mesh first (dist.new_group is a collective of the whole world; a rank that "
                "stops half-way leaves the others waiting in it)"
            )

    def kinds(self, calls, mesh) -> list[tuple[str, str]]:
        """Each recorded collective: its kind and its group (the inner or outer axis's name,
        "world" or "another group")."""
        import torch.distributed as dist

        def which(group):
            if group is self._get(mesh, "row_group"):
                return self.inner
            if group is self._get(mesh, "column_group"):
                return self.outer
            if group is None or group is dist.group.WORLD:
                return "world"
            return "another group"

        return [(collectives.kind(c.name), which(c.group)) for c in calls if c.name != "new_group"]
