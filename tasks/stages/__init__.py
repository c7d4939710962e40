"""The stages: one module per stage, named as its stage (its `STAGE` constant), in the order of a
run (`iteration`):

    build_csgs -> calibrate_window                          (run-level)
    rollout -> score_atoms -> compute_advantages -> [recast_gains] -> train_epoch   (iteration k)
    evaluate                                                 (flow cast-eval)

Each is `stage(store, recipe, upstream refs..., iteration) -> StageRef` on `tasks.store.stage`'s
protocol, plus its Prefect task. What they share: the stage order and which iteration is next
(`iteration`), the Prefect task wrapper and the guard it runs first, which rebuilds damaged inputs
(`guard`), recipes (`recipe`; their sections `recipe_sections` and `recipe_method`), what a
recipe's names load (`models`), prompt files (`prompt_sets`), the policy of an iteration (`policy_state`), the
update `train_epoch` runs on inputs it has read (`train_update`), the LLM scene-graph cache
(`csg_cache`), progress bars (`progress`), the plots a stage stores as PNG blobs with the
repository's one figure-to-PNG helper (`plots`), and the shapes backbone's pre-training
(`pretrain_shapes`, flow `pretrain-shapes`).

May import `tasks.store`; nothing from `tasks.reporting`.
"""
