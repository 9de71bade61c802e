/**
 * Widgets whose worker ended, marked as JupyterLab marks a restarted kernel's:
 * the broken-link `jupyter-widgets-disconnected` mark on each view.
 *
 * A worker's widget models are its comms; once the worker ends (release, a
 * lost node, `--on-idle release`) nothing answers them, yet their views still
 * move. ipywidgets marks views dead only when the whole kernel restarts, and a
 * `comm_close` would delete the views instead, so the extension marks them:
 * every widget view in the notebook whose model is not among the kernel's comms
 * (`comm_info_request`, which lists both sides while a worker is attached).
 * A parked worker keeps its comms: nothing is marked while parked.
 */
import type { CodeCell } from '@jupyterlab/cells';
import { NotebookPanel } from '@jupyterlab/notebook';
import { Kernel } from '@jupyterlab/services';

const VIEW_MIME = 'application/vnd.jupyter.widget-view+json';
const DEAD = 'jupyter-widgets-disconnected';
/** Set on the views this module marked, so that only those are unmarked again. */
const OURS = 'gpupoolDead';

/** The ids of the kernel's live widget comms, or null when it could not tell (its worker did not answer). */
export async function liveWidgetComms(kernel: Kernel.IKernelConnection): Promise<Set<string> | null> {
  const reply = await kernel.requestCommInfo({ target_name: 'jupyter.widget' });
  const content = reply.content as any;
  if (content.status !== 'ok' || content.gpupool_worker_comms === 'unknown') {
    return null;
  }
  return new Set(Object.keys(content.comms || {}));
}

/** Mark the views in `panel` whose model is not in `live`; unmark the ones marked here that are live again. */
export function markDeadWidgets(panel: NotebookPanel, live: Set<string>): void {
  for (const cell of panel.content.widgets) {
    if (cell.model.type !== 'code') {
      continue;
    }
    const outputs = (cell as CodeCell).outputArea;
    outputs.widgets.forEach((child, index) => {
      const view = outputs.model.get(index)?.data[VIEW_MIME] as { model_id?: string } | undefined;
      const node = view?.model_id ? child.node.querySelector<HTMLElement>('.jupyter-widgets') : null;
      if (!node) {
        return;
      }
      if (!live.has(view!.model_id!)) {
        if (!node.classList.contains(DEAD)) {
          node.classList.add(DEAD);
          node.dataset[OURS] = '1';
        }
      } else if (node.dataset[OURS]) {
        node.classList.remove(DEAD);
        delete node.dataset[OURS];
      }
    });
  }
}
