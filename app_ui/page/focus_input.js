// After an answer: the focus back in the message box, the page left where it was.
() => {
  document.querySelector('#chat-input textarea')?.focus({ preventScroll: true });
}
