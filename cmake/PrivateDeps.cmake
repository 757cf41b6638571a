# remora_private_dependency(target dep...): `target` compiles and links
# against each `dep` (and so does everything in this build that links
# `target`), but the installed package asks a user's program only to link
# them, never to see their headers: `$<LINK_ONLY:dep>` in the exported
# usage requirements. For gRPC, protobuf, CUDA and NCCL, which remora's
# public headers never include: a user's LibTorch may carry other versions
# of those headers (docs/architecture.md, "The installed package").
function(remora_private_dependency target)
  foreach(dep ${ARGN})
    target_link_libraries(${target} PUBLIC $<BUILD_INTERFACE:${dep}>
                          INTERFACE $<INSTALL_INTERFACE:$<LINK_ONLY:${dep}>>)
  endforeach()
endfunction()
